"""GiftConfig: every option of every frontend in one frozen record, checked once."""
import dataclasses
import inspect
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from horovod_gift import GiftConfig
from horovod_gift.ddp import GiftState
from horovod_gift.fsdp import attach

BAD = [  # option, a bad value, what the error must say
    ("format", "fp6", "unknown format 'fp6'"),
    ("transform", "pca", "unknown transform 'pca'"),
    ("rounding", "up", "unknown rounding 'up'"),
    ("block_size", 12, "nvfp4 has fixed 16-element blocks; got block_size=12"),
    ("nonfinite", "warn", "nonfinite must be 'nan' or 'raise', got 'warn'"),
    ("topology", "ring", "unknown topology 'ring'"),
    ("node_size", 0, "node_size must be None .* or a positive int, got 0"),
    ("min_elements", 0, "min_elements must be a positive int, got 0"),
    ("bucket_elements", 1.5, "bucket_elements must be a positive int, got 1.5"),
    ("whitening_rank", -1, "whitening_rank must be a positive int"),
    ("refresh_every", 0, "refresh_every must be a positive int"),
    ("stat_window", "5", "stat_window must be a positive int"),
    ("damping", 0.0, "damping must be positive, got 0.0"),
    ("start_step", -1, "start_step must be a non-negative int, got -1"),
    ("log_every", -2, "log_every must be a non-negative int, got -2"),
    ("hadamard_block", True, "hadamard_block must be a power of two, got True"),
    ("residual_dtype", torch.float16, "residual_dtype must be one of"),
    ("hadamard_block", 100, "hadamard_block must be a power of two, got 100"),
    ("param_format", "int8", "param_format must be one of .*, got 'int8'"),
]


@pytest.mark.parametrize("option, value, message", BAD, ids=[b[0] for b in BAD])
def test_each_bad_option_is_refused_by_name(option, value, message):
    with pytest.raises(ValueError, match=message):
        GiftConfig(**{option: value})


def test_int3_takes_its_fixed_block_only():
    assert GiftConfig(format="int3").block_size is None
    assert GiftConfig(format="int3", block_size=32).block_size == 32
    with pytest.raises(ValueError, match="int3 has fixed 32-element blocks; got block_size=16"):
        GiftConfig(format="int3", block_size=16)


def test_a_grad_scaler_must_be_one():
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler, got int"):
        GiftConfig(grad_scaler=3)


def test_the_config_is_frozen_and_replaced_by_keywords():
    config = GiftConfig(format="fp8_e4m3")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.format = "nvfp4"
    assert GiftConfig.of(config, GiftConfig, {"seed": 3}) == GiftConfig(format="fp8_e4m3",
                                                                          seed=3)
    assert GiftConfig.of(None, GiftConfig.for_fsdp, {}).residual_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown format"):
        GiftConfig.of(config, GiftConfig, {"format": "fp6"})


@pytest.mark.parametrize("options, message", [
    (dict(transform="auto"), r"transform must be one of \('whiten', 'none'\), got 'auto'"),
    (dict(nonfinite="raise"), "nonfinite must be 'nan', got 'raise'"),
    (dict(start_step=2), "start_step does not apply"),
    (dict(bucket_elements=1 << 10), "bucket_elements does not apply"),
])
def test_what_fsdp_cannot_honour_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        GiftConfig.for_fsdp(**options).refuse_for_fsdp()


def test_diloco_defaults_to_nvfp4_the_format_that_kept_fp32_diloco_loss_on_two_replica_groups():
    """INT3 cost about 1 % of held-out loss against fp32 DiLoCo with 2 replica groups, NVFP4
    none (benchmarks/results/diloco_cluster_2x2.md): a user who names nothing gets NVFP4."""
    config = GiftConfig.for_diloco()
    assert (config.format, config.transform, config.error_feedback) == ("nvfp4", "hadamard", True)
    assert GiftConfig.for_diloco(format="int3").format == "int3"


def test_param_format_is_refused_outside_fsdp():
    with pytest.raises(ValueError, match="GIFT: param_format applies to FSDP's"):
        GiftConfig(param_format="fp8_e4m3").refuse_param_format("GIFT")


@pytest.mark.parametrize("entry", [GiftState, attach])
def test_help_lists_every_option_with_the_frontends_default(entry):
    parameters = inspect.signature(entry).parameters
    for field in dataclasses.fields(GiftConfig):
        assert field.name in parameters, field.name
    expected = torch.bfloat16 if entry is attach else torch.float32
    assert parameters["residual_dtype"].default == expected


def test_every_option_has_a_comment_and_the_readme_table_is_made_from_them():
    """One list of options: each GiftConfig field is commented where it is declared, and the
    README's table of options is the one scripts/options_table.py makes from those comments."""
    root = pathlib.Path(__file__).resolve().parent.parent
    source = (root / "horovod_gift" / "config.py").read_text().splitlines()
    for field in dataclasses.fields(GiftConfig):
        line = next(i for i, text in enumerate(source)
                    if text.startswith(f"    {field.name}: "))
        assert source[line - 1].strip().startswith("#"), f"{field.name} has no comment"
    result = subprocess.run([sys.executable, str(root / "scripts" / "options_table.py"),
                             "--check"], capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr


DUMMY = """    # a dummy option, added by the test: the one edit an option needs
    dummy_option: int = field(default=7, metadata=NUMERIC)
"""
DEMO = """
import inspect, sys
sys.path.insert(0, {scripts!r})
from horovod_gift import GiftConfig
from horovod_gift.core.state_base import GiftStateBase
from horovod_gift.ddp import GiftState
from horovod_gift.fsdp import attach
import options_table
for entry in (GiftState.__init__, attach):      # help() lists it, with its default
    assert inspect.signature(entry).parameters["dummy_option"].default == 7, entry
GiftConfig(dummy_option=3)                      # the frontends accept it
class State:
    config = GiftConfig(dummy_option=3)
# the ranks' check and the checkpoints' compare it
assert GiftStateBase.agreed(State())["dummy_option"] == 3
assert "| `dummy_option` | `7` | `7` | `7` | a dummy option" in options_table.table()
print("ok")
"""


def test_adding_an_option_touches_config_py_alone(tmp_path):
    """Issue 56: a copy of the package with one field added to GiftConfig (its comment and its
    NUMERIC mark) and nothing else changed: every frontend's signature lists it, the ranks'
    check and the checkpoints compare it, and the README's table has its row."""
    root = pathlib.Path(__file__).resolve().parent.parent
    copy = tmp_path / "horovod_gift"
    shutil.copytree(root / "horovod_gift", copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    config = copy / "config.py"
    text = config.read_text()
    anchor = "    # log what GIFT does at its first step\n"
    assert anchor in text
    config.write_text(text.replace(anchor, DUMMY + anchor))
    changed = [p for p in copy.rglob("*.py")
               if p.read_bytes() != (root / "horovod_gift" / p.relative_to(copy)).read_bytes()]
    assert changed == [config]
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    # the script reads the config.py of the package beside it
    shutil.copy(root / "scripts" / "options_table.py", scripts)
    result = subprocess.run([sys.executable, "-c", DEMO.format(scripts=str(scripts))],
                            capture_output=True, text=True, cwd=tmp_path,
                            env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert result.stdout.strip() == "ok", result.stderr[-3000:]
