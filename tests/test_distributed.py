"""posttrain.distributed on a local Ray cluster (loopback, 2 CPUs): placement, sandbox workers, RL with 2 engine
actors and a 2-rank FSDP trainer (gloo) against the one-process run, and the fault paths.

Tolerances: with the same seeds the engine actors sample the very tokens one process samples (rewards and
episodes are equal), and the 2-rank trainer's losses equal one process's within 1e-6 (absolute) and its weights
within 1e-4 after the steps (float sums in another order; Adam turns tiny gradient differences into at most
~1e-5 of weight here, against ~3e-3 of total change). Runs of the same backend are equal bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import test_rl_pipeline  # noqa: F401 - registers the `test_digits` domain here too
import torch
from safetensors.torch import load_file

from posttrain.config.rl import RLRecipe

ray = pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
STEPS, PROMPTS, GROUP = 4, 3, 4


@pytest.fixture(scope="module")
def ray_cluster():
    """A private 2-CPU Ray instance on loopback; workers import the test domain (`test_digits`, a smooth digit-share
    reward) from tests/test_rl_pipeline.py, as `cluster.worker_imports` says."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning",
             # the checkout's src first: the workers run the code under test, not another installed copy
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)]),
                                       "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


def recipe(policy_dir, output, ray_backend: bool = True, train: dict | None = None, **cluster) -> RLRecipe:
    section = {"backend": "ray", "num_rollout_workers": 2, "num_trainer_workers": 2,
               "rollout": {"num_cpus": 0.5, "threads": 1}, "trainer": {"num_cpus": 0.5, "threads": 1},
               "worker_imports": ["test_rl_pipeline"], **cluster} if ray_backend else {}
    return RLRecipe.model_validate({
        "output_dir": str(output),
        "model": {"path": str(policy_dir)},
        "domains": [{"name": "test_digits", "heldout": 0}],
        "rollout": {"prompts_per_step": PROMPTS, "sampling": {"group_size": GROUP, "max_new_tokens": 8}},
        "optim": {"lr": 1e-3},
        "train": {"max_steps": STEPS, "micro_batch_size": 5, "save_every": 2, **(train or {})},
        "pipeline": {"self_test": True},
        "runtime": {"precision": "fp32"},
        "tracking": {"tensorboard": False, "progress": False},
        "cluster": section,
    })


def figures(result) -> list[tuple[float, float, float]]:
    return [(m["train/loss"], m["train/grad_norm"], m["reward/mean"]) for m in result.history]


def episodes(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]


def max_weight_gap(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max(float((wa[key] - wb[key]).abs().max()) for key in wa)


def named_actor(suffix: str):
    names = [name for name in ray.util.list_named_actors() if name.endswith(suffix)]
    assert len(names) == 1, names
    return ray.get_actor(names[0])


# ---- fast: part of the default suite ---------------------------------------------------------------------


def test_split_and_shares_are_deterministic_and_in_step():
    from posttrain.distributed.engines import _split
    from posttrain.distributed.parallel import TorchDataParallel

    assert _split(7, 3) == [(0, 3), (3, 5), (5, 7)] and _split(1, 2) == [(0, 1), (1, 1)]
    ranks = [TorchDataParallel.__new__(TorchDataParallel) for _ in range(2)]
    for rank, shard in enumerate(ranks):
        shard.rank, shard.world_size, shard._units, shard.context_parallel = rank, 2, [], False
    shares = [shard.micro_batches(list(range(7)), 2) for shard in ranks]
    assert shares == [[[0, 2], [4, 6]], [[1, 3], [5]]]  # same count on both ranks, every item once
    assert [shard.micro_batches([0], 4) for shard in ranks] == [[[0]], [[]]]  # rank 1 idles, in step


def test_auto_data_parallel_replicates_small_models_and_shards_big_ones(monkeypatch):
    import torch

    from posttrain.distributed import parallel
    from posttrain.distributed.errors import DistributedError

    model = torch.nn.Linear(64, 64)  # 16.6 kB of parameters
    assert parallel.data_parallel_mode("auto", model) == "replicate"
    monkeypatch.setattr(parallel, "REPLICATE_BYTES", 1000)
    assert parallel.data_parallel_mode("auto", model) == "fsdp"
    assert parallel.data_parallel_mode("replicate", model) == "replicate"
    with pytest.raises(DistributedError, match="cluster.data_parallel: expected auto, fsdp or replicate"):
        parallel.data_parallel_mode("zero3", model)


def _gather_rank(rank: int, world: int, port: int, results) -> None:
    from torch.distributed.tensor import DTensor

    from posttrain.distributed.parallel import TorchDataParallel
    from posttrain.models import build_tiny_model, train_tokenizer

    torch.set_num_threads(1)
    tokenizer = train_tokenizer(["12+34=46 the quick brown fox"] * 20, vocab_size=301)  # rows not divisible by 3
    model = build_tiny_model("tiny-1m", tokenizer, seed=0)
    parallel = TorchDataParallel.start(rank, world, f"tcp://127.0.0.1:{port}", "cpu")
    model = parallel.shard_model(model, "fsdp")
    with torch.no_grad():
        for parameter in model.parameters():  # shards that differ per rank and per row
            parameter.to_local().add_(torch.arange(parameter.to_local().numel()).view_as(parameter.to_local())
                                      * 1e-3 + rank)
    expected = {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
                for name, t in model.state_dict().items()}
    got = parallel.full_state_dict(model)
    if rank == 0:
        results.put(got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected))
    parallel.close(finished=True)


@pytest.mark.slow
def test_the_sharded_weights_gather_in_one_collective_equals_full_tensor():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_gather_rank, args=(3, port, results), nprocs=3)  # 3 ranks: uneven and empty row shards
    assert results.get() is True


@pytest.mark.ray
def test_placement_is_checked_before_anything_starts(ray_cluster, policy_dir, tmp_path):
    from posttrain.distributed import PlacementError, launch_rl

    config = recipe(policy_dir, tmp_path / "run", num_rollout_workers=4, rollout={"num_cpus": 1},
                    trainer={"num_cpus": 1})
    with pytest.raises(PlacementError, match=r"4 rollout workers x 1 \+ 2 trainer ranks x 1 = 6 CPUs, but .* has 2"):
        launch_rl(config)
    assert not ray.util.list_named_actors()  # nothing was started
    gpus = recipe(policy_dir, tmp_path / "run", trainer={"num_cpus": 0.5, "num_gpus": 1})
    with pytest.raises(PlacementError, match="2 trainer ranks x 1 = 2 GPUs, but .* has 0"):
        launch_rl(gpus)


def test_ray_refuses_a_run_without_model_path(tmp_path):
    from posttrain.config import RLRecipe, load_recipe
    from posttrain.distributed import DistributedError, launch_rl

    fresh = load_recipe(None, [f"output_dir={tmp_path / 'run'}", "cluster.backend=ray"], RLRecipe)
    with pytest.raises(DistributedError, match="cluster.backend: ray needs model.path"):
        launch_rl(fresh)  # the workers could not build the driver's fresh built-in model


@pytest.mark.ray
def test_sandbox_workers_run_jails_and_survive_a_kill(ray_cluster):
    import asyncio

    from posttrain.config.common import ClusterConfig
    from posttrain.distributed.cluster import Placement, Role
    from posttrain.distributed.sandbox import RaySandboxPool, start_sandbox_workers
    from posttrain.distributed.trainer import kill_all
    from posttrain.sandbox import Sandbox

    cluster = ClusterConfig(backend="ray", num_sandbox_workers=2, sandbox_slots=2, sandbox={"num_cpus": 0.5},
                            sandbox_backend="bubblewrap" if shutil.which("bwrap") else "unsafe-local")
    placement = Placement(cluster, [Role("sandbox workers", 2, cluster.sandbox)])
    workers = start_sandbox_workers(cluster, placement, "posttrain-test")
    try:
        box = Sandbox(pool=RaySandboxPool(workers))
        assert box.run_python("print(6 * 7)").stdout == "42\n"
        before = ray.get(workers[0].pid.remote())

        async def many():
            runs = [box.arun_python(f"import time; time.sleep(0.5); print({i})") for i in range(6)]
            return await asyncio.gather(*runs)

        threading.Timer(0.3, lambda: ray.kill(workers[0], no_restart=False)).start()
        results = asyncio.run(many())
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]  # every run once, none lost
        assert all(r.status == "ok" for r in results)
        assert ray.get(workers[0].pid.remote()) != before  # the killed worker was restarted
    finally:
        kill_all(ray, workers)
        placement.close()


# ---- slow: whole RL runs on Ray --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_run(ray_cluster, policy_dir, tmp_path_factory):
    from posttrain.distributed import launch_rl

    return launch_rl(recipe(policy_dir, tmp_path_factory.mktemp("ray") / "run", data_parallel="fsdp"))


@pytest.mark.ray
@pytest.mark.slow
def test_rl_on_ray_matches_the_one_process_run(ray_run, policy_dir, tmp_path):
    from posttrain.rl.trainer import run_rl

    local = run_rl(recipe(policy_dir, tmp_path / "local", ray_backend=False))
    assert len(ray_run.history) == len(local.history) == STEPS
    for (loss_a, norm_a, reward_a), (loss_b, norm_b, reward_b) in zip(figures(local), figures(ray_run)):
        assert reward_a == reward_b  # the engine actors sampled the same tokens
        assert loss_b == pytest.approx(loss_a, abs=1e-6) and norm_b == pytest.approx(norm_a, rel=1e-4)
    assert [e["messages"] for e in episodes(local.output_dir)] == [e["messages"] for e in episodes(ray_run.output_dir)]
    assert max_weight_gap(local.final_dir, ray_run.final_dir) < 1e-4
    assert max_weight_gap(policy_dir, local.final_dir) > 1e-3  # it trained: the weights moved ~100x the gap
    # Every engine acknowledged each version; each batch was sampled with the version it was due.
    assert all(m["cluster/engines_at_version"] == 2 for m in ray_run.history)
    assert [e["policy_version"] for e in episodes(ray_run.output_dir)] == [
        step for step in range(STEPS) for _ in range(PROMPTS * GROUP)]
    assert all(m["time/weight_sync_s"] >= 0 and m["time/weights_gather_s"] > 0 for m in ray_run.history)


@pytest.mark.ray
@pytest.mark.slow
def test_shared_prefix_on_sharded_ranks_matches_the_one_process_run(ray_cluster, policy_dir, tmp_path):
    """`train.shared_prefix` under a 2-rank FSDP trainer: each rank lays out the groups of its share of the batch
    (a group split between ranks shares its prompt on each side), with the tolerances of the padded layout."""
    from posttrain.distributed import launch_rl
    from posttrain.rl.trainer import run_rl as run_local

    shared = {"shared_prefix": True}
    local = run_local(recipe(policy_dir, tmp_path / "local", ray_backend=False, train=shared))
    sharded = launch_rl(recipe(policy_dir, tmp_path / "sharded", train=shared, data_parallel="fsdp"))
    assert len(sharded.history) == len(local.history) == STEPS
    for (loss_a, norm_a, reward_a), (loss_b, norm_b, reward_b) in zip(figures(local), figures(sharded)):
        assert reward_a == reward_b
        assert loss_b == pytest.approx(loss_a, abs=1e-6) and norm_b == pytest.approx(norm_a, rel=1e-4)
    assert max_weight_gap(local.final_dir, sharded.final_dir) < 1e-4
    # the shared layout scored most tokens on both sides (a step that trains a single sequence has no prompt to
    # share; the ranks' smaller micro-batches hold a lone sequence now and then)
    shares = [(m["train/shared_prefix"], n["train/shared_prefix"]) for m, n in zip(local.history, sharded.history)]
    assert sum(a == 1.0 and b > 0.5 for a, b in shares) >= STEPS - 1, shares
    padded = run_local(recipe(policy_dir, tmp_path / "padded", ray_backend=False))
    assert max_weight_gap(padded.final_dir, sharded.final_dir) < 1e-4  # the layout changes the sums' order only


@pytest.mark.ray
@pytest.mark.slow
def test_replicated_ranks_match_the_one_process_run_and_resume_exactly(ray_cluster, policy_dir, tmp_path):
    from posttrain.distributed import launch_rl
    from posttrain.rl.trainer import run_rl as run_local

    local = run_local(recipe(policy_dir, tmp_path / "local", ray_backend=False))
    replicated = launch_rl(recipe(policy_dir, tmp_path / "replicated", data_parallel="replicate"))
    for (loss_a, norm_a, reward_a), (loss_b, norm_b, reward_b) in zip(figures(local), figures(replicated)):
        assert reward_a == reward_b
        assert loss_b == pytest.approx(loss_a, abs=1e-6) and norm_b == pytest.approx(norm_a, rel=1e-4)
    assert max_weight_gap(local.final_dir, replicated.final_dir) < 1e-4
    # Stopped after step 2 (its checkpoint), resumed to the end: the same steps as the run that went through.
    stopped = recipe(policy_dir, tmp_path / "stopped", data_parallel="replicate")
    launch_rl(stopped, on_step=lambda step, metrics: step == 2)
    resumed = launch_rl(stopped, resume=True)
    assert [m["policy/version"] for m in resumed.history] == [0.0, 1.0, 2.0, 3.0]  # steps 1-2 from metrics.jsonl
    assert figures(resumed) == figures(replicated)
    assert max_weight_gap(resumed.final_dir, replicated.final_dir) == 0.0


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_rollout_worker_is_restarted_and_no_episode_is_lost_or_doubled(ray_run, policy_dir, tmp_path):
    from posttrain.distributed import launch_rl

    def kill_soon(step, metrics):
        if step == 1:  # lands while the next batch is being rolled out (or just before): both must recover
            worker = named_actor("-rollout-0")
            threading.Timer(0.2, lambda: ray.kill(worker, no_restart=False)).start()

    killed = launch_rl(recipe(policy_dir, tmp_path / "killed", data_parallel="fsdp"), on_step=kill_soon)
    assert killed.history[-1]["cluster/rollout_restarts"] >= 1
    logged = episodes(killed.output_dir)
    assert len(logged) == STEPS * PROMPTS * GROUP
    per_group = Counter((e["step"], e["group_id"]) for e in logged)
    assert sorted(Counter(step for step, _ in per_group).values()) == [PROMPTS] * STEPS
    assert set(per_group.values()) == {GROUP}  # every group whole, none twice
    assert figures(killed) == figures(ray_run)  # the same episodes, the same steps, bit for bit
    assert max_weight_gap(killed.final_dir, ray_run.final_dir) == 0.0


@pytest.mark.ray
@pytest.mark.slow
def test_a_dead_trainer_rank_stops_the_run_and_resume_continues_exactly(ray_run, policy_dir, tmp_path):
    from posttrain.distributed import TrainerRankError, launch_rl

    def kill_rank(step, metrics):
        if step == 3:
            ray.kill(named_actor("-trainer-1"), no_restart=True)

    with pytest.raises(TrainerRankError, match="--resume"):
        launch_rl(recipe(policy_dir, tmp_path / "run", data_parallel="fsdp"), on_step=kill_rank)
    time.sleep(0.5)
    assert not [name for name in ray.util.list_named_actors() if "-trainer-" in name]  # the group was stopped
    resumed = launch_rl(recipe(policy_dir, tmp_path / "run", data_parallel="fsdp"), resume=True)
    assert [m["policy/version"] for m in resumed.history] == [0.0, 1.0, 2.0, 3.0]  # resumed at step 2's checkpoint
    assert figures(resumed) == figures(ray_run)
    assert max_weight_gap(resumed.final_dir, ray_run.final_dir) == 0.0
    # The checkpoint is one process's: the local backend resumes it too.
    assert (resumed.output_dir / "checkpoints" / "latest").read_text().strip() == "step-000004"
    assert torch.load(resumed.output_dir / "checkpoints" / "step-000004" / "training_state.pt",
                      weights_only=False)["optimizer"]["state"]


@pytest.mark.ray
@pytest.mark.bwrap
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_black_box_agents_run_on_ray_beside_their_endpoint(ray_cluster, policy_dir, tmp_path):
    """The rollout worker hosts each episode's endpoint and runs the agent's jail in a pool of its own, while the
    sandbox workers (remote, in general) keep the tools and verifiers: every episode is judged, none is infra,
    and the history-rewriting agent's two segments reach the trainer rank."""
    from test_envs_agent import rewriting_agent_recipe
    from test_envs_tools import bwrap_available

    from posttrain.distributed import launch_rl

    if not bwrap_available():
        pytest.skip("bubblewrap not available")
    cluster = {"backend": "ray", "num_rollout_workers": 1, "num_trainer_workers": 1, "num_sandbox_workers": 1,
               "rollout": {"num_cpus": 0.5, "threads": 1}, "trainer": {"num_cpus": 0.5, "threads": 1},
               "sandbox": {"num_cpus": 0.5}, "sandbox_backend": "bubblewrap"}
    result = launch_rl(RLRecipe.model_validate(rewriting_agent_recipe(tmp_path, policy_dir, cluster=cluster,
                                                                      runtime={"precision": "fp32"})))

    logged = episodes(result.output_dir)
    assert len(logged) == 2 and all(e["domain"] == "agent" for e in logged)
    assert not [e for e in logged if e["failure"] in ("infra", "sandbox_failure")], logged
    assert result.history[0]["rollout/sequences"] == 4.0  # two episodes, two segments each, on the trainer rank
