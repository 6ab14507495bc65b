"""`TextStream` decodes incrementally (a window of the last tokens): its text after every token must be what
decoding all the tokens at once gives, for a byte-level BPE (characters split across tokens) and a
SentencePiece-style Metaspace tokenizer (a leading space stripped at a sequence's start)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from posttrain.models import train_tokenizer
from posttrain.serve.prompting import TextStream

TEXTS = ["héllo wörld — ünïcode 日本語 ✓ and plain words", "The answer is 42. Thé ånswer is førty-two! 🙂🙂",
         "print('naïve café')  # tabs\tand  double  spaces", "αβγ δεζ ηθι κλμ"] * 20


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_streamed_text_is_the_whole_decode_after_every_token(kind):
    tokenizer = train_tokenizer(TEXTS, vocab_size=400) if kind == "byte-level" else _metaspace_tokenizer()
    rng = random.Random(0)
    sequences = [tokenizer.encode(text, add_special_tokens=False) * 3 for text in TEXTS[:4]]
    # random ids too: multi-byte characters cut anywhere, special tokens in between
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(80)] for _ in range(6)]
    for tokens in sequences:
        stream, sent = TextStream(tokenizer, [], False), ""
        for count, token in enumerate(tokens, 1):
            sent += stream.add(token)
            assert stream.text == tokenizer.decode(tokens[:count], skip_special_tokens=True)
        whole = tokenizer.decode(tokens, skip_special_tokens=True)
        assert sent + stream.finish(whole)[0] == whole
