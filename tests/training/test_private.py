"""The one home of transformers' private surface: its import check names what is missing, one `patched` helper."""

import configparser
from pathlib import Path

import pytest
import transformers
import transformers.modeling_utils as hf_modeling
import transformers.trainer as hf_trainer
from transformers import Trainer

from hf_pretrain.training import private
from hf_pretrain.training.private import (
    PRIVATE_SURFACE,
    SUPPORTED_TRANSFORMERS,
    TrainerPrivateOverrides,
    check_private_surface,
    patched,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_transformers_has_every_private_name():
    check_private_surface()


@pytest.mark.parametrize(
    "owner, name, listed",
    [
        (Trainer, "_run_epoch", "Trainer._run_epoch"),
        (hf_trainer, "skip_first_batches", "transformers.trainer.skip_first_batches"),
        (hf_modeling, "safe_save_file", "transformers.modeling_utils.safe_save_file"),
    ],
)
def test_a_missing_private_name_fails_in_one_line(monkeypatch, owner, name, listed):
    monkeypatch.delattr(owner, name)
    with pytest.raises(ImportError) as error:
        check_private_surface()
    message = str(error.value)
    assert "\n" not in message
    assert listed in message and transformers.__version__ in message and SUPPORTED_TRANSFORMERS in message


def test_an_attribute_the_trainer_no_longer_sets_is_named():
    with pytest.raises(ImportError, match=r"Trainer\.create_scheduler\._not_set_there"):
        check_private_surface(("Trainer.create_scheduler._not_set_there",))


def test_every_private_override_is_checked():
    overridden = {
        f"Trainer.{name}"
        for name in vars(TrainerPrivateOverrides)
        if name.startswith("_") and not name.startswith("__") and hasattr(Trainer, name)
    }
    assert overridden and overridden <= set(PRIVATE_SURFACE)


def test_the_supported_range_is_setup_cfg_s():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirements = config["options"]["install_requires"].split()
    assert f"transformers{SUPPORTED_TRANSFORMERS}" in requirements


def test_patched_restores_the_global_even_on_error():
    original = hf_trainer.rotate_checkpoints
    with pytest.raises(RuntimeError), patched(hf_trainer, "rotate_checkpoints", None):
        assert hf_trainer.rotate_checkpoints is None
        raise RuntimeError
    assert hf_trainer.rotate_checkpoints is original
    skip = hf_trainer.skip_first_batches
    with private.batch_skipping_off():
        assert hf_trainer.skip_first_batches([1, 2], 1) == [1, 2]
    assert hf_trainer.skip_first_batches is skip
