"""kvcopy's vLLM spec refuses a bad configuration, and a vLLM it was not tested with, when it is built: before
any transfer, in the role that builds it. Without vLLM the module still imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")


import kvcopy.integrations.vllm as kv_vllm
from kvcopy.integrations.vllm import _compat

from helpers.vllm import make_rig

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        ({"cpu_bytes_to_use": None}, ValueError, "cpu_bytes_to_use: required"),  # None: the key is left out
        ({"cpu_bytes_to_use": 0}, ValueError, "cpu_bytes_to_use: expected a positive number of bytes, got 0"),
        ({"cpu_bytes_to_use": -5}, ValueError, "expected a positive number of bytes, got -5"),
        ({"cpu_bytes_to_use": "lots"}, TypeError, "cpu_bytes_to_use: expected a number of bytes, got str"),
        ({"cpu_bytes_to_use": 100}, ValueError, "hold no chunk"),
        ({"kvcopy_policy": "recompute"}, ValueError, "kvcopy_policy: expected one of \\('auto', 'offload'\\)"),
        ({"kvcopy_method": "warp"}, ValueError, "kvcopy_method: expected 'auto' or one of"),
        ({"kvcopy_learn": "maybe"}, TypeError, "kvcopy_learn: expected true or false"),
        ({"kvcopy_decode_share": 1.5}, ValueError, "kvcopy_decode_share: expected a fraction in \\[0, 1\\)"),
    ],
)
def test_a_bad_configuration_fails_when_the_spec_is_built(tmp_path, extra, error, message):
    with pytest.raises(error, match=message):
        make_rig(tmp_path, extra=extra)


def test_a_missing_profile_path_fails_when_the_spec_is_built(tmp_path):
    missing = tmp_path / "nowhere.json"
    with pytest.raises(kv_vllm.ProfileNotFoundError, match="kvcopy_profile: no profile at") as caught:
        make_rig(tmp_path, extra={"kvcopy_profile": str(missing)})
    assert isinstance(caught.value, FileNotFoundError) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize("version", ["0.32.2", "0.34.0", "1.0.0"])
def test_a_vllm_outside_the_tested_range_is_a_runtime_error(tmp_path, monkeypatch, version):
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    with pytest.raises(RuntimeError, match=f"tested with vLLM >=0.33,<0.34; this is vLLM {version}"):
        make_rig(tmp_path)


def test_the_tested_range_accepts_its_patch_releases():
    for version in ("0.33.0", "0.33.1", "0.33.2rc1", "0.33.0+cu130"):
        _compat.check_vllm(version)


@pytest.mark.slow
def test_the_module_imports_without_vllm_and_building_says_how_to_install():
    script = (
        "import sys; sys.modules['vllm'] = None\n"  # an interpreter where `import vllm` fails
        "import kvcopy.integrations.vllm as m\n"
        "try:\n    m.KVCopyOffloadingSpec(None)\nexcept ImportError as e:\n    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert "ImportError: kvcopy.integrations.vllm needs vLLM >=0.33,<0.34: pip install --no-deps" in out.stdout
