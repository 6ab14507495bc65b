"""Data: SFT samples (chat + metadata), readers, mixing, dedup, decontamination, tokenization, packing.

    from posttrain.data import prepare_sft_data, collate, model_inputs
    prepared = prepare_sft_data(recipe.data, tokenizer, seed=0, rejects_dir="runs/sft")
    batch = collate(prepared.epoch_rows(0)[:32], tokenizer.pad_token_id)
    loss = model(**model_inputs(batch)).loss

See docs/data.md for the record format and every knob; chats with images: `read_vision_samples`
(docs/multimodal.md).
"""

from posttrain.data.decontaminate import (
    DecontaminationResult,
    EvalItem,
    NgramIndex,
    decontaminate,
    ngram_hashes,
    prompt_key,
    read_eval_items,
)
from posttrain.data.dedup import DedupResult, conversation_text, deduplicate, normalize_text
from posttrain.data.mixing import GroupShare, MixResult, group_name, mix, mixture_table
from posttrain.data.packing import (
    IGNORE_INDEX,
    Row,
    block_causal_mask,
    build_epoch,
    collate,
    cu_seq_lens,
    model_inputs,
)
from posttrain.data.pipeline import PreparedSFTData, prepare_sft_data, read_all_texts
from posttrain.data.formats import SourceFormat, detect_format
from posttrain.data.images import (
    IMAGE_FORMATS,
    VisionSample,
    iter_vision_samples,
    load_image,
    pillow,
    read_vision_samples,
    validate_vision_record,
)
from posttrain.data.vision_sets import (
    VisionData,
    VisionPairSample,
    read_vision_pair_data,
    read_vision_sft_data,
    validate_vision_pair,
    vision_prompt_key,
    vision_texts,
)
from posttrain.data.readers import (
    RejectLog,
    iter_samples,
    read_jsonl_records,
    read_records,
    read_samples,
    resolve_format,
)
from posttrain.data.schema import DataError, RecordError, SampleMetadata, SFTSample, validate_record
from posttrain.data.split import prompt_fraction, split_by_hash
from posttrain.data.stream import BloomFilter, RowStream, StreamingSFTData, prepare_streaming_sft_data
from posttrain.data.tokenize import (
    TokenizedSample,
    TokenizeResult,
    assistant_spans,
    conversation_for_training,
    prompt_ids,
    render_chat,
    tokenize_sample,
    tokenize_samples,
)
from posttrain.data.flywheel import episodes_to_pairs, episodes_to_sft, read_episodes, write_records
from posttrain.data.preference import (
    PreferenceData,
    TokenizedPair,
    collate_pairs,
    load_preference_data,
    pair_texts,
    tokenize_pairs,
)

__all__ = [
    "IMAGE_FORMATS",
    "VisionData",
    "VisionPairSample",
    "VisionSample",
    "read_vision_pair_data",
    "read_vision_sft_data",
    "validate_vision_pair",
    "vision_prompt_key",
    "vision_texts",
    "iter_vision_samples",
    "load_image",
    "pillow",
    "read_vision_samples",
    "validate_vision_record",
    "BloomFilter",
    "DataError",
    "DecontaminationResult",
    "DedupResult",
    "EvalItem",
    "GroupShare",
    "IGNORE_INDEX",
    "MixResult",
    "NgramIndex",
    "PreferenceData",
    "PreparedSFTData",
    "RecordError",
    "RejectLog",
    "Row",
    "RowStream",
    "SFTSample",
    "SampleMetadata",
    "SourceFormat",
    "StreamingSFTData",
    "TokenizeResult",
    "TokenizedPair",
    "TokenizedSample",
    "assistant_spans",
    "block_causal_mask",
    "build_epoch",
    "collate",
    "collate_pairs",
    "conversation_for_training",
    "conversation_text",
    "cu_seq_lens",
    "decontaminate",
    "deduplicate",
    "detect_format",
    "episodes_to_pairs",
    "episodes_to_sft",
    "group_name",
    "iter_samples",
    "load_preference_data",
    "mix",
    "mixture_table",
    "model_inputs",
    "ngram_hashes",
    "normalize_text",
    "pair_texts",
    "prepare_sft_data",
    "prepare_streaming_sft_data",
    "prompt_fraction",
    "prompt_ids",
    "prompt_key",
    "read_all_texts",
    "read_episodes",
    "read_eval_items",
    "read_jsonl_records",
    "read_records",
    "read_samples",
    "render_chat",
    "resolve_format",
    "split_by_hash",
    "tokenize_pairs",
    "tokenize_sample",
    "tokenize_samples",
    "validate_record",
    "write_records",
]
