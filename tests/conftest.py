"""Shared fixtures: a tiny tokenizer and model built locally in well under a second."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _corpus():
    from posttrain.tasks import get_domain, sample_tasks

    domain = get_domain("arithmetic", operators="+-")
    texts = []
    for task in sample_tasks(domain, 200, level=[1, 2, 3], seed=1):
        sample = domain.demonstration(task)
        texts += [m["content"] for m in sample.messages] + [sample.metadata.reasoning_trace or ""]
    texts += ['{"name": "calculator", "arguments": {"expression": "2+3"}}', "The invoice total is $1,234.50."]
    return texts


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from posttrain.models import train_tokenizer

    return train_tokenizer(_corpus(), vocab_size=384)


@pytest.fixture()
def tiny_model(tiny_tokenizer):
    from posttrain.models import build_tiny_model

    return build_tiny_model("tiny-1m", tiny_tokenizer, seed=0)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, tiny_tokenizer):
    """The tiny model saved as a Hugging Face directory, for runs that load their policy from a path."""
    from posttrain.models import build_tiny_model, save_model_dir

    path = tmp_path_factory.mktemp("policy")
    save_model_dir(path, build_tiny_model("tiny-1m", tiny_tokenizer, seed=0), tiny_tokenizer)
    return path


def pytest_configure(config):
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (restored after): decoding or training a tiny model on a shared CPU
    with several OpenMP threads spinning against other processes turns seconds into minutes. Use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
