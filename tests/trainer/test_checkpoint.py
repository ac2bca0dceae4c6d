"""Checkpoints: SIGKILLed saves and resumes, no pickle loaded, the newest complete one resumed,
no non-finite weights saved, FSDP2 shards restored."""
import datetime
import glob
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict

import numpy as np
import pytest
import torch

from dapo_trainer import checkpoint as ckpt
from dapo_trainer import state_file
from dapo_trainer.config import load_config
from dapo_trainer.hf_io import load_hf_model
from dapo_trainer.model import ModelConfig, Transformer
from dapo_trainer.trainer import DAPOTrainer
from tests.helpers import spawn_process_group
from tests.trainer.tiny import micro_setup

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                   head_dim=4, max_position_embeddings=8)
# The attention kernels need a head dim >= 16 for a forward pass.
SMALL = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                    head_dim=16, max_position_embeddings=16)


def _tiny_parts(fill=None):
    model = Transformer(TINY).init_weights(std=0.1)
    if fill is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(fill)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _save(root, step, parts, **state):
    model, opt, sch = parts
    return ckpt.save_checkpoint(root, step, model=model, full_state=model.state_dict(), optimizer=opt,
                                scheduler=sch, trainer_state={"step": step, **state})


def test_sigkill_at_every_file_operation_and_at_random_times(tmp_path):
    """The harness (tests/trainer/ckpt_kill.py) kills savers before each of their file operations
    and at random times, then resumes: each resume is the last finished state or the save in
    flight, read back whole (weights, moments and state of one save), and no finished
    checkpoint is lost."""
    # tmpfs when there is one: the saves fsync every file, slow on a loaded disk.
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    work = tempfile.mkdtemp(prefix="ckpt_kill_", dir=base)
    out = tmp_path / "records.jsonl"
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "tests.trainer.ckpt_kill", work, str(out), "12"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    switched = defaultdict(list)
    for r in records:
        allowed = [tuple(a) if a else None for a in r["allowed"]]
        got = r["resumed"]
        assert got is None or len(got) == 5, r  # else the resume raised
        resumed = (got[0], got[2]) if got else None
        assert resumed in allowed, r  # never a wrong step or an older state than the last finished one
        if got:
            dir_step, step, version, weights, moments = got
            assert dir_step == step and weights == [version] and moments == [version], r  # one save, whole
            assert r["latest"] == str(step), r
        for s, v in r["versions"].items():  # no finished checkpoint lost
            ok = {v} | ({r["inflight"][1]} if r["inflight"] and r["inflight"][0] == int(s) else set())
            assert r["loadable"].get(s) in ok, (s, r)
        if r["mode"] == "sweep" and r["inflight"]:
            switched[tuple(r["inflight"])].append(resumed == tuple(r["inflight"]))
    sweep = [r for r in records if r["mode"] == "sweep"]
    total = sweep[0]["total"]
    assert total >= 40 and [r["k"] for r in sweep] == list(range(1, total + 2))  # every boundary, then none
    assert sum(r["recovery_kills"] for r in sweep) >= 10  # resumes killed mid-recovery too
    random_kills = [r for r in records if r["mode"] == "random"]
    assert len(random_kills) == 12 and any(r["inflight"] for r in random_kills)
    # Within one save, killed before its first operation it resumes the previous state, before
    # its last one the new state, and it switches exactly once.
    assert len(switched) == 4
    for flags in switched.values():
        assert not flags[0] and flags[-1] and flags == sorted(flags), switched
    assert sweep[-1]["resumed"][:3] == [1, 1, 4]  # not killed: the rollback's re-save of step 1 is the newest
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]  # no saver failed to resume


def test_resume_skips_incomplete_checkpoints_and_says_why(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    parts = _tiny_parts()
    for step in (1, 2, 3):
        _save(root, step, parts)
    for path in glob.glob(os.path.join(root, "global_step_3", "optim_rank0.*")) + \
            glob.glob(os.path.join(root, "global_step_2", "manifest.json")):
        os.remove(path)
    with caplog.at_level(logging.INFO, logger="dapo_trainer.checkpoint"):
        assert ckpt.latest_checkpoint(root) == os.path.join(root, "global_step_1")
    text = caplog.text
    assert "global_step_3 skipped: optim_rank0.safetensors is missing" in text
    assert "global_step_2 skipped: no manifest.json: its save did not finish" in text
    assert open(os.path.join(root, ckpt.LATEST_FILE)).read() == "1"


def _evil_pickle(marker: str) -> bytes:
    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    return pickle.dumps({"step": 1, "rng": Evil()})


def _rehash(ckpt_dir):
    """Rewrite ``ckpt_dir``'s manifest hashes to its files' current content."""
    path = os.path.join(ckpt_dir, ckpt.MANIFEST)
    man = json.load(open(path))
    man["sha256"] = {name: ckpt._sha256(os.path.join(ckpt_dir, name)) for name in man["files"]}
    json.dump(man, open(path, "w"))


def test_flipped_bytes_of_the_same_size_are_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """Two flipped bytes in a checkpoint's model.safetensors (its size unchanged): resuming, by auto or by
    path, is a ValueError naming the file, raised before the trainer builds a model."""
    import dapo_trainer.trainer as trainer_mod

    overrides = micro_setup(str(tmp_path)) + ["trainer.total_training_steps=1", "trainer.val_before_train=false",
                                              "data.val_files=[]"]
    DAPOTrainer(load_config(overrides=overrides)).fit()
    d = os.path.join(str(tmp_path), "run", "checkpoints", "global_step_1")
    weights = os.path.join(d, "model", "model.safetensors")
    data = bytearray(open(weights, "rb").read())
    for at in (len(data) - 40, len(data) - 7):  # tensor bytes, past the header
        data[at] ^= 0xFF
    open(weights, "wb").write(bytes(data))
    assert ckpt.incomplete_reason(d) is None  # the sizes alone pass

    def no_model(*a, **k):
        raise AssertionError("a model was built from a corrupted checkpoint")

    monkeypatch.setattr(trainer_mod, "build_model", no_model)
    for extra in ([], ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={d}"]):
        with pytest.raises(ValueError, match=r"model\.safetensors' does not match its sha256 in manifest.json"):
            DAPOTrainer(load_config(overrides=overrides + ["trainer.total_training_steps=2"] + extra))


def test_planted_pickle_is_refused_and_never_run(tmp_path):
    """A crafted pickle in place of a checkpoint's state files: resume refuses it, nothing runs."""
    overrides = micro_setup(str(tmp_path)) + ["trainer.total_training_steps=1", "trainer.val_before_train=false",
                                              "data.val_files=[]"]
    DAPOTrainer(load_config(overrides=overrides)).fit()
    d = os.path.join(str(tmp_path), "run", "checkpoints", "global_step_1")
    marker = str(tmp_path / "pwned")
    payload = _evil_pickle(marker)
    state_files = [f for f in os.listdir(d) if f.startswith(("state_rank0", "optim_rank0"))]
    assert state_files
    for name in state_files + ["state_rank0.pt", "optim_rank0.pt"]:
        path = os.path.join(d, name)
        # Same size as the file it replaces: the manifest's check passes, the loader must refuse.
        size = os.path.getsize(path) if os.path.exists(path) else len(payload)
        with open(path, "wb") as f:
            f.write(payload + b"\0" * max(0, size - len(payload)))
    _rehash(d)  # an attacker who can plant files can edit the manifest too: the loader must still refuse
    for extra in ([], ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={d}"]):  # auto, by path
        with pytest.raises(Exception) as err:
            DAPOTrainer(load_config(overrides=overrides + extra))
        assert not os.path.exists(marker), "the planted pickle ran"
        assert err.type is ValueError and "not a dapo_trainer state file" in str(err.value)


def test_old_pickle_checkpoint_is_skipped_with_reason(tmp_path, caplog):
    """A checkpoint of the pickle era (``*.pt`` state, no manifest) is never loaded."""
    root = tmp_path / "ckpt"
    d = root / "global_step_4"
    (d / "model").mkdir(parents=True)
    marker = str(tmp_path / "pwned")
    (d / "state_rank0.pt").write_bytes(_evil_pickle(marker))
    (root / ckpt.LATEST_FILE).write_text("4")
    with caplog.at_level(logging.WARNING, logger="dapo_trainer.checkpoint"):
        assert ckpt.latest_checkpoint(str(root)) is None
    assert "global_step_4 skipped: pickled state (*.pt) from an older version" in caplog.text
    assert not os.path.exists(marker)


def test_state_file_round_trip_and_refusals(tmp_path):
    state = {"rng": ckpt.rng_state(), "nested": {3: (torch.arange(6).view(2, 3)[:, 1], [np.float32(2.5), None]),
                                                 "__x": True, (1, "a"): torch.zeros(0, 2)},
             "view_twice": [torch.ones(4)[:2], torch.ones(4)[2:]], "nan": float("nan")}
    path = str(tmp_path / "s.safetensors")
    state_file.save_state_file(state, path)
    back = state_file.load_state_file(path)
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert back["rng"]["python"] == state["rng"]["python"]  # tuples survive: random.setstate takes them
    np.testing.assert_array_equal(back["rng"]["numpy"][1], state["rng"]["numpy"][1])
    assert back["rng"]["numpy"][1].dtype == np.uint32
    assert torch.equal(back["nested"][3][0], torch.tensor([1, 4])) and back["nested"][3][1] == [2.5, None]
    assert back["nested"]["__x"] is True and back["nested"][(1, "a")].shape == (0, 2)
    assert back["nan"] != back["nan"]
    with pytest.raises(TypeError, match=r"state\['f'\] is a function"):
        state_file.save_state_file({"f": lambda: 0}, path)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="bad.safetensors is not a dapo_trainer state file"):
        state_file.load_state_file(str(bad))


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    root = str(tmp_path / "ckpt")
    parts = _tiny_parts()
    _save(root, 1, parts)
    with torch.no_grad():
        parts[0].lm_head.weight[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"refusing to checkpoint step 2: non-finite weights in \['lm_head.weight'\]"):
        _save(root, 2, parts)
    assert sorted(os.listdir(root)) == ["global_step_1", ckpt.LATEST_FILE]
    assert ckpt.latest_checkpoint(root) == os.path.join(root, "global_step_1")


def _fsdp_worker(rank: int, root: str):
    import torch.distributed as dist

    from dapo_trainer.parallel import apply_fsdp, full_state_dict, make_mesh

    torch.set_num_threads(1)
    mesh = make_mesh("cpu", tp=1)["dp"]

    def build(path=None):
        torch.manual_seed(0)
        model = load_hf_model(path) if path else Transformer(SMALL).init_weights(std=0.1)
        apply_fsdp(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))

    def step(model, opt, sch, seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, SMALL.vocab_size, (6,), generator=g)
        hidden = model(ids, torch.tensor([0, 6], dtype=torch.int32), 6)
        model.log_probs(hidden, ids.roll(-1))[0].sum().backward()
        opt.step()
        sch.step()
        opt.zero_grad()

    a = build()
    step(*a, seed=1)
    full = full_state_dict(a[0])
    ckpt.save_checkpoint(root, 1, model=a[0], full_state=full, optimizer=a[1], scheduler=a[2],
                         trainer_state={"step": 1})
    b = build(os.path.join(root, "global_step_1", "model"))
    assert ckpt.load_checkpoint(os.path.join(root, "global_step_1"), optimizer=b[1], scheduler=b[2])["step"] == 1
    step(*a, seed=2)
    step(*b, seed=2)
    fa, fb = full_state_dict(a[0]), full_state_dict(b[0])
    if rank == 0:
        for k in fa:
            assert torch.equal(fa[k], fb[k]), k
    dist.barrier()


@pytest.mark.multiproc
def test_fsdp2_optimizer_shards_resume_exactly(tmp_path):
    """FSDP2 keeps each rank's Adam moments as DTensor shards: saved per rank as plain tensors,
    loaded back as shards of the new model's parameters, the next step is identical."""
    spawn_process_group(_fsdp_worker, 2, str(tmp_path / "ckpt"), timeout=datetime.timedelta(seconds=120))


# --------------------------------------------------------------------------- issue 40, items 15 and 16
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A micro run's overrides after one step, checkpointed at ``run/checkpoints/global_step_1``."""
    root = str(tmp_path_factory.mktemp("trained"))
    overrides = micro_setup(root) + ["trainer.total_training_steps=1", "trainer.val_before_train=false",
                                     "data.val_files=[]"]
    DAPOTrainer(load_config(overrides=overrides)).fit()
    return root, overrides + ["trainer.total_training_steps=2"]


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: the error must come before."""
    import dapo_trainer.trainer as trainer_mod

    def built(*a, **k):
        raise AssertionError("a model was built before the error")
    monkeypatch.setattr(trainer_mod, "build_model", built)


def _copy_run(trained, tmp_path, **manifest):
    """A copy of the trained run under ``tmp_path`` with ``manifest``'s keys set in global_step_1's
    manifest (None: removed); returns (checkpoint dir, overrides for the copy)."""
    root, overrides = trained
    run = str(tmp_path / "run")
    shutil.copytree(os.path.join(root, "run", "checkpoints"), os.path.join(run, "checkpoints"))
    d = os.path.join(run, "checkpoints", "global_step_1")
    path = os.path.join(d, ckpt.MANIFEST)
    man = json.load(open(path))
    for k, v in manifest.items():
        man[k] = v
        if v is None:
            del man[k]
    json.dump(man, open(path, "w"))
    return d, overrides + [f"trainer.default_local_dir={run}"]


PP2 = {"pp": 2, "vpp": 1, "dp": 1, "tp": 1, "sp": 1, "ep": 1}


@pytest.mark.parametrize("layout,saved", [(PP2, r"2 processes, PP=2 x VPP=1 x DP=1 x TP=1 x SP=1 x EP=1"),
                                          (None, "2 processes")])
def test_resume_at_another_world_size_names_both_layouts_and_what_loads(trained, tmp_path, no_model, layout,
                                                                        saved):
    """A checkpoint saved by 2 processes (PP=2; or an older manifest with its world size only), resumed by
    one: a ValueError before any model is built naming the saved and the current world size and layout,
    and the checkpoint's model directory, which the docs promise loads at PP=1 (was: "no state for rank
    0" from load_checkpoint, although state_rank0 exists)."""
    d, overrides = _copy_run(trained, tmp_path, world_size=2, layout=layout)
    with pytest.raises(ValueError) as e:
        DAPOTrainer(load_config(overrides=overrides))
    msg = str(e.value)
    assert f"was saved by {saved}; this run has 1 process" in msg, msg
    assert f"actor_rollout_ref.model.path={d}/model, trainer.resume_mode=disable" in msg
    assert "no state for rank" not in msg


def test_pp2_checkpoint_at_pp1_dp2_is_refused_naming_both_and_its_model_loads_at_pp1(trained, tmp_path):
    """The trainer records its parallel layout in the manifest; a PP=2 checkpoint resumed at PP=1 x DP=2
    (the same world size) is refused naming both layouts (was: a torch optimiser group-size traceback),
    the saved layout passes, and its model directory starts a new run at PP=1 as docs/parallelism.md says."""
    root, overrides = trained
    d = os.path.join(root, "run", "checkpoints", "global_step_1")
    assert json.load(open(os.path.join(d, ckpt.MANIFEST)))["layout"] == {**PP2, "pp": 1}
    d, _ = _copy_run(trained, tmp_path, world_size=2, layout=PP2)
    with pytest.raises(ValueError, match=r"saved by 2 processes, PP=2 x VPP=1 x DP=1 x TP=1 x SP=1 x EP=1; this run "
                                         r"has 2 processes, PP=1 x VPP=1 x DP=2 x TP=1 x SP=1 x EP=1\. A resume "
                                         r"restores"):
        ckpt.check_resume_layout(d, 2, {**PP2, "pp": 1, "dp": 2})
    ckpt.check_resume_layout(d, 2, PP2)
    fresh = DAPOTrainer(load_config(overrides=overrides + [
        f"actor_rollout_ref.model.path={d}/model", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={tmp_path}/new"]))
    assert fresh.global_step == 0 and fresh.resume_dir is None


def test_resume_from_path_at_the_checkpoints_directory_names_its_checkpoints(trained, no_model):
    """trainer.resume_from_path naming the checkpoints directory, not a global_step_N one (verl also wants
    a global_step dir): a ValueError naming the global_step_N directories it holds and the newest one
    (was: "its save did not finish")."""
    root, overrides = trained
    path = os.path.join(root, "run", "checkpoints")
    with pytest.raises(ValueError, match=rf"trainer.resume_from_path: '{path}' is a checkpoints directory holding "
                                         rf"global_step_1, not one checkpoint: name one of them \(e.g. "
                                         rf"{path}/global_step_1\)"):
        DAPOTrainer(load_config(overrides=overrides + ["trainer.resume_mode=resume_path",
                                                       f"trainer.resume_from_path={path}"]))


def test_dangling_symlink_default_local_dir_is_refused_before_any_model(trained, tmp_path, no_model):
    """trainer.default_local_dir a symbolic link to a directory that does not exist: a ValueError naming
    the key and the link's target before any model is built or directory created (was: FileExistsError
    after the model was built)."""
    _, overrides = trained
    link, target = tmp_path / "run", tmp_path / "gone" / "run"
    os.symlink(target, link)
    with pytest.raises(ValueError, match=rf"^trainer.default_local_dir: '{link}' is a symbolic link to "
                                         rf"'{target}', which does not exist"):
        DAPOTrainer(load_config(overrides=overrides + [f"trainer.default_local_dir={link}"]))
    assert not os.path.exists(tmp_path / "gone")


@pytest.mark.parametrize("failing,named", [(1, "model"), (2, "optim_rank0.safetensors"),
                                           (3, "state_rank0.safetensors")])
def test_disk_full_during_save_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failing,
                                                                                named):
    """The writer failing with ENOSPC at the model, the optimiser or the state file: a CheckpointWriteError
    (an OSError, errno ENOSPC) naming that file and the directory (was: safetensors' SafetensorError
    without a path); the partial save is removed and the previous checkpoint stays the one resumed."""
    import errno

    import safetensors.torch

    root = str(tmp_path / "ckpt")
    parts = _tiny_parts()
    _save(root, 1, parts)
    real, calls = safetensors.torch.save_file, []

    def full_disk(*a, **k):
        calls.append(a[1])
        if len(calls) == failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        _save(root, 2, parts)
    tmp = os.path.join(root, ".global_step_2.tmp")
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert f"checkpoint of step 2: writing '{os.path.join(tmp, named)}' failed (OSError: [Errno 28] No space" in \
        str(e.value)
    assert f"the previous complete checkpoints under '{root}' are kept" in str(e.value)
    assert sorted(os.listdir(root)) == ["global_step_1", ckpt.LATEST_FILE]
    assert ckpt.latest_checkpoint(root) == os.path.join(root, "global_step_1")
