"""SFT sharded over 2 processes (FSDP2 on gloo): a torchrun launch and Ray actors, against one process, with the
same checkpoints and an exact resume.

Tolerances: the 2-rank losses equal one process's within 1e-5 and the final weights within 1e-4 (the same sums
in another order); a sharded resume equals the uninterrupted sharded run within 1e-6.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file
from test_sft import data_file  # noqa: F401 - the SFT tests' arithmetic chat data (a module fixture)

from posttrain.config import SFTRecipe, load_recipe
from posttrain.tracking import read_metrics
from posttrain.train.sft import run_sft

pytestmark = pytest.mark.slow


def write_recipe(directory: Path, data_file: Path, max_steps: int, **cluster) -> Path:
    recipe = {
        "stage": "sft",
        "output_dir": str(directory / "run"),
        "model": {"preset": "tiny-1m"},
        "data": {"train": [{"path": str(data_file)}], "heldout_fraction": 0.05, "max_length": 128},
        "optim": {"lr": 3e-3, "schedule": "constant"},
        "train": {"batch_size": 16, "micro_batch_size": 4, "max_steps": max_steps, "log_every": 1, "save_every": 3},
        "runtime": {"precision": "fp32", "num_threads": 1},
        "tracking": {"tensorboard": False, "progress": False},
        "cluster": cluster,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(recipe: Path, *extra: str) -> None:
    run_launcher([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                  "127.0.0.1", "--master_port", str(free_port()), "-m", "posttrain", "sft", str(recipe), *extra])


def run_launcher(command: list[str]) -> None:
    """Run a command that starts ranks (one thread each), asserting it succeeds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # A new session, so a timeout can end the launcher and its ranks together.
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=600)  # a loaded 2-core machine
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 0, stderr[-3000:]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r}


def weight_gap(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return max(float((wa[key] - wb[key]).abs().max()) for key in wa)


@pytest.mark.parametrize("mode", ["fsdp", "replicate"])
def test_torchrun_sharded_sft_matches_one_process_and_resumes_exactly(tmp_path, data_file, mode):
    single = run_sft(load_recipe(write_recipe(tmp_path / "single", data_file, 6), schema=SFTRecipe))
    sharded = tmp_path / "sharded"
    torchrun(write_recipe(sharded, data_file, 6, data_parallel=mode))
    one, two = losses(single.output_dir), losses(sharded / "run")
    assert one.keys() == two.keys() == set(range(1, 7))
    assert all(two[step] == pytest.approx(one[step], abs=1e-5) for step in one)
    assert weight_gap(single.final_dir, sharded / "run" / "final") < 1e-4
    # Rank 0 wrote one process's checkpoint: step 3's optimizer state is whole tensors.
    state = __import__("torch").load(sharded / "run" / "checkpoints" / "step-000003" / "training_state.pt",
                                     weights_only=False)
    assert state["cursor"]["step"] == 3 and state["optimizer"]["state"]

    # Stop after step 3 (its checkpoint), then resume sharded to step 6: the same steps 4-6.
    crashed = tmp_path / "crashed"
    torchrun(write_recipe(crashed, data_file, 3, data_parallel=mode))
    torchrun(write_recipe(crashed, data_file, 6, data_parallel=mode), "--resume")
    resumed = losses(crashed / "run")
    assert all(resumed[step] == pytest.approx(two[step], abs=1e-6) for step in (4, 5, 6))
    assert weight_gap(crashed / "run" / "final", sharded / "run" / "final") < 1e-6


@pytest.mark.ray
def test_sft_on_ray_actors_matches_the_torchrun_launch(tmp_path, data_file):
    ray = pytest.importorskip("ray")
    from posttrain.distributed import launch_sft as run_distributed

    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        recipe = load_recipe(write_recipe(tmp_path / "ray", data_file, 4, backend="ray", num_trainer_workers=2,
                                          trainer={"num_cpus": 1, "threads": 1}), schema=SFTRecipe)
        result = run_distributed(recipe)
    finally:
        ray.shutdown()
    torchrun(write_recipe(tmp_path / "torchrun", data_file, 4))
    assert losses(result.output_dir) == losses(tmp_path / "torchrun" / "run")
    assert weight_gap(result.final_dir, tmp_path / "torchrun" / "run" / "final") == 0.0
