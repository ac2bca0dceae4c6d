"""Fixtures of the npu_ops tests: the fake torch_npu, installed per test."""
import pytest

from npu_ops import _lazy
from tests.npu_fake import fake_torch_npu


@pytest.fixture
def fake_npu(monkeypatch):
    """The fake ``torch_npu`` in ``sys.modules`` (see fake_torch_npu.py); its ``calls`` log starts empty."""
    _lazy.reset()
    mod = fake_torch_npu.install(monkeypatch)
    yield mod
    _lazy.reset()
