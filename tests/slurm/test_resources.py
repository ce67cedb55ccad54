"""Per-tier Slurm resources: the GPU a tier asks Slurm for (`--gres=gpu:<type>:1`, `--constraint`), and the
batch size and precision the trainer is told, which must fit every GPU those allow. Under Slurm `device_index`
is accepted and has no effect: it names a card of this host, and Slurm picks the GPU (documented in
docs/slurm.md). /healthz lists every active job."""
from __future__ import annotations

import pytest

from lora_worker.config import ConfigError, Settings, SlurmResources, load_settings
from tests.slurm.fakes import SlurmWorker, close_worker, slurm_worker


def flag(argv: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]


@pytest.fixture
def tiered(host) -> SlurmWorker:
    worker, app = slurm_worker(host, slurm_resources={
        **Settings().slurm_resources,
        "quality": SlurmResources("gpu:a6000:1", "ampere&vram48", 2, "bf16"),
        "fast": SlurmResources("gpu:v100:1", "", 1, "fp16")})
    yield worker
    close_worker(worker, app)


def test_a_tiers_gres_constraint_batch_and_precision_reach_sbatch_and_the_trainer(tiered: SlurmWorker):
    slurm = tiered
    quality = slurm.submit(0, tier="quality", device_index=0)  # device 0 here is the 24 GB card
    fast = slurm.submit(1, tier="fast", device_index=1)  # device 1 here is the 48 GB card (batch 2 locally)
    q_opts, f_opts = (slurm.scheduler.options[j.slurm_job_id] for j in (quality, fast))
    assert "--gres=gpu:a6000:1" in q_opts and "--constraint=ampere&vram48" in q_opts
    assert "--gres=gpu:v100:1" in f_opts and not [o for o in f_opts if o.startswith("--constraint")]
    assert flag(quality.argv, "train_batch_size") == ["2"] and flag(quality.argv, "mixed_precision") == ["bf16"] * 2
    # A pre-Ampere GPU gets fp16 from the launcher and the script alike, and the tier's batch, not the card's.
    assert flag(fast.argv, "train_batch_size") == ["1"] and flag(fast.argv, "mixed_precision") == ["fp16"] * 2


def test_device_index_under_slurm_picks_nothing(slurm: SlurmWorker):
    """Locally device 0 (24 GB) refuses quality and device 1 trains at batch 2; under Slurm neither holds."""
    one = slurm.submit(0, tier="quality", device_index=0)
    two = slurm.submit(1, tier="quality", device_index=1)
    assert flag(one.argv, "train_batch_size") == flag(two.argv, "train_batch_size") == ["1"]
    assert slurm.scheduler.options[one.slurm_job_id] == [
        o.replace(f"lora-{two.id}-", f"lora-{one.id}-").replace(f"/{two.id}.", f"/{one.id}.")
        for o in slurm.scheduler.options[two.slurm_job_id]]
    assert slurm.submit(2, tier="fast", device_index=63).status == "queued"  # no such card here: no matter


def test_healthz_lists_every_active_job(slurm: SlurmWorker):
    jobs = [slurm.submit(n) for n in range(3)]
    body = slurm.client.get("/healthz").get_json()
    assert body["active_job_ids"] == [j.id for j in jobs] and body["active_job_id"] == jobs[0].id


@pytest.mark.parametrize("spec, words", [
    ({"gres": "gpu:2"}, "one GPU"), ({"gres": "gpu:a100:1 --uid=0"}, "gres"), ({"gres": "mps:1"}, "gres"),
    ({"mixed_precision": "fp32"}, "mixed_precision"), ({"train_batch_size": 0}, "train_batch_size"),
    ({"constraint": "a b"}, "constraint"), ({"batch": 2}, "unknown key")])
def test_resources_slurm_cannot_take_are_refused_at_start_up(spec, words, tmp_path):
    with pytest.raises(ConfigError, match=words):
        load_settings({"LORA_WORKER_BACKEND": "slurm", "LORA_WORKER_STATE_DIR": str(tmp_path),
                       "LORA_WORKER_SLURM_RESOURCES": __import__("json").dumps({"quality": spec})})


def test_resources_from_the_environment_keep_the_other_tiers_defaults(tmp_path):
    s = load_settings({"LORA_WORKER_BACKEND": "slurm", "LORA_WORKER_STATE_DIR": str(tmp_path),
                       "LORA_WORKER_SLURM_RESOURCES": '{"quality": {"gres": "gpu:a100:1", "train_batch_size": 2}}'})
    assert s.slurm_resources["quality"] == SlurmResources("gpu:a100:1", "", 2, "bf16")
    assert s.slurm_resources["fast"] == Settings().slurm_resources["fast"] == SlurmResources()


def test_the_slurm_settings_know_every_tier():
    from lora_worker.config import TIERS
    from lora_worker.config_slurm import TIER_NAMES

    assert set(TIER_NAMES) == set(TIERS)
