"""kvcopy's vLLM spec refuses a bad configuration, and a vLLM it was not tested with, when it is built: before
any transfer, in the role that builds it. Without vLLM the module still imports."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")


import kvcopy.integrations.vllm as kv_vllm
from kvcopy.integrations.vllm import _compat
from kvcopy.integrations.vllm._config import KEYS, SpecConfig, read_config

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
        ({"kvcopy_method": "warp"}, ValueError, "kvcopy_method: expected one of \\('auto', "),
        ({"kvcopy_learn": "maybe"}, ValueError, "kvcopy_learn: expected true or false"),
        ({"kvcopy_decode_share": 1.5}, ValueError, "kvcopy_decode_share: expected a fraction in \\[0, 1\\)"),
        ({"kvcopy_decode_share": 1.0}, ValueError, "kvcopy_decode_share: expected a fraction in \\[0, 1\\), got 1.0"),
        ({"kvcopy_polcy": "offload"}, ValueError, "kvcopy_polcy: not a kvcopy extra-config key"),
        ({"cpu_bytes_to_use": 0.5}, ValueError, "cpu_bytes_to_use: expected a whole number of bytes, got 0.5"),
        ({"kvcopy_policy": 1}, TypeError, "kvcopy_policy: expected one of .*, got int 1"),
    ],
)
def test_a_bad_configuration_fails_when_the_spec_is_built(tmp_path, extra, error, message):
    with pytest.raises(error, match=message):
        make_rig(tmp_path, extra=extra)


# read_config alone: every key checked, a wrong type a TypeError and a wrong value a ValueError, each naming its
# key. BYTES is a valid cpu_bytes_to_use, given with each case.
BYTES = 1 << 22


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kvcopy_policy": 1}, "kvcopy_policy: expected one of \\('auto', 'offload'\\), got int 1"),
        ({"kvcopy_policy": None}, "kvcopy_policy: expected one of .*, got NoneType None"),
        ({"kvcopy_method": None}, "kvcopy_method: expected one of \\('auto', .*, got NoneType None"),
        ({"kvcopy_method": ["cpu"]}, "kvcopy_method: expected one of .*, got list"),
        ({"kvcopy_learn": 1}, "kvcopy_learn: expected true or false, got int 1"),
        ({"kvcopy_learn": None}, "kvcopy_learn: expected true or false, got NoneType"),
        ({"kvcopy_decode_share": "0.5"}, "kvcopy_decode_share: expected a fraction in \\[0, 1\\), got str"),
        ({"kvcopy_decode_share": True}, "kvcopy_decode_share: expected a fraction in \\[0, 1\\), got bool"),
        ({"kvcopy_decode_share": None}, "kvcopy_decode_share: expected a fraction"),
        ({"kvcopy_profile": 5}, "kvcopy_profile: expected a path"),
        ({"cpu_bytes_to_use": "1G"}, "cpu_bytes_to_use: expected a number of bytes, got str"),
        ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use: expected a number of bytes, got bool"),
        ({"cpu_bytes_to_use": None}, "cpu_bytes_to_use: expected a number of bytes, got NoneType"),
        ({"kvcopy_agents": True}, "kvcopy_agents: expected one of \\('auto', 'off'\\), got bool"),
        ({"kvcopy_agent_max_leased_fraction": "half"}, "kvcopy_agent_max_leased_fraction: expected a fraction"),
        ({"kvcopy_agent_max_session_fraction": None}, "kvcopy_agent_max_session_fraction: expected a fraction"),
        ({"kvcopy_agent_forecast": 3}, "kvcopy_agent_forecast: expected a path"),
    ],
)
def test_a_value_of_the_wrong_type_is_a_type_error_naming_its_key(extra, message):
    with pytest.raises(TypeError, match=message):
        read_config({"cpu_bytes_to_use": BYTES, **extra})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kvcopy_policy": "Auto"}, "kvcopy_policy: expected one of .*, got 'Auto' \\(did you mean 'auto'\\?\\)"),
        ({"kvcopy_method": "cpuu"}, "kvcopy_method: expected one of .*, got 'cpuu' \\(did you mean 'cpu'\\?\\)"),
        ({"kvcopy_learn": "yes"}, "kvcopy_learn: expected true or false, got 'yes'"),
        ({"kvcopy_decode_share": 1.0}, "kvcopy_decode_share: expected a fraction in \\[0, 1\\), got 1.0"),
        ({"kvcopy_decode_share": 1}, "kvcopy_decode_share: expected a fraction in \\[0, 1\\), got 1"),
        ({"kvcopy_decode_share": -1e-9}, "kvcopy_decode_share: .*got -1e-09"),
        ({"kvcopy_decode_share": math.nan}, "kvcopy_decode_share: .*got nan"),
        ({"kvcopy_decode_share": 10**400}, "kvcopy_decode_share: expected a fraction in \\[0, 1\\), got 1000"),
        ({"cpu_bytes_to_use": 0.5}, "cpu_bytes_to_use: expected a whole number of bytes, got 0.5 \\(.*not GiB"),
        ({"cpu_bytes_to_use": 4096.25}, "cpu_bytes_to_use: expected a whole number of bytes, got 4096.25"),
        ({"cpu_bytes_to_use": math.inf}, "cpu_bytes_to_use: expected a whole number of bytes, got inf"),
        ({"cpu_bytes_to_use": -4096.0}, "cpu_bytes_to_use: expected a positive number of bytes, got -4096"),
        ({"kvcopy_agents": "on"}, "kvcopy_agents: expected one of \\('auto', 'off'\\), got 'on'"),
        ({"kvcopy_agent_max_leased_fraction": 1.5}, "kvcopy_agent_max_leased_fraction: .* in \\[0, 1\\], got 1.5"),
        ({"kvcopy_agent_max_session_fraction": -0.1}, "kvcopy_agent_max_session_fraction: .*got -0.1"),
        ({"kvcopy_agent_forecast": "."}, "kvcopy_agent_forecast: '.' is a directory"),
    ],
)
def test_a_wrong_value_is_a_value_error_naming_its_key(extra, message):
    with pytest.raises(ValueError, match=message):
        read_config({"cpu_bytes_to_use": BYTES, **extra})


def test_the_agents_keys_are_read(tmp_path):
    config = read_config({"cpu_bytes_to_use": BYTES})
    assert (config.agents, config.max_leased_fraction, config.max_session_fraction) == ("auto", 0.5, 0.1)
    assert config.forecast_path is None
    path = tmp_path / "gaps.json"  # (need not exist yet: the forecaster is saved there)
    config = read_config(
        {
            "cpu_bytes_to_use": BYTES,
            "kvcopy_agents": "off",
            "kvcopy_agent_max_leased_fraction": 1,
            "kvcopy_agent_max_session_fraction": 0.25,
            "kvcopy_agent_forecast": path,
        }
    )
    assert (config.agents, config.max_leased_fraction, config.max_session_fraction) == ("off", 1.0, 0.25)
    assert config.forecast_path == str(path)


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("kvcopy_polcy", "kvcopy_policy"),
        ("kvcopy_decodeshare", "kvcopy_decode_share"),
        ("KVCOPY_LEARN", "kvcopy_learn"),
        ("kvcopy_turbo_mode", None),
    ],
)
def test_a_kvcopy_key_kvcopy_does_not_read_is_refused_with_the_known_ones(typo, meant):
    with pytest.raises(ValueError) as caught:
        read_config({"cpu_bytes_to_use": BYTES, typo: "auto"})
    message = str(caught.value)
    assert message.startswith(f"{typo}: not a kvcopy extra-config key")
    assert (f"did you mean {meant!r}?" in message) if meant else ("did you mean" not in message)
    assert all(key in message for key in KEYS)


def test_vllms_own_keys_pass_through_unread():
    config = read_config({"cpu_bytes_to_use": BYTES, "blocks_per_chunk": 2, "eviction_policy": "arc", "spec_name": "x"})
    assert config == SpecConfig(cpu_bytes_to_use=BYTES)


def test_a_missing_byte_count_names_a_close_key_the_user_wrote():
    with pytest.raises(ValueError, match=r"cpu_bytes_to_use: required .*'cpu_byte_to_use' is there: a typo"):
        read_config({"cpu_byte_to_use": BYTES})


def test_a_byte_count_is_an_int_or_a_whole_float():
    """vLLM reads the key as int(value), and its kv_offloading_size (GiB) makes it GiB x 2**30, a float: a whole
    float is that many bytes; a fraction of a byte is refused (above), never rounded down to 0."""
    assert read_config({"cpu_bytes_to_use": 1.5 * 2**30}).cpu_bytes_to_use == 3 << 29
    assert read_config({"cpu_bytes_to_use": 1e9}).cpu_bytes_to_use == 10**9
    assert read_config({"cpu_bytes_to_use": 1}).cpu_bytes_to_use == 1


@pytest.mark.parametrize("share", [0, 0.0, 0.5, math.nextafter(1.0, 0.0)])
def test_the_decode_share_takes_every_fraction_from_0_up_to_but_not_1(share):
    assert read_config({"cpu_bytes_to_use": BYTES, "kvcopy_decode_share": share}).decode_share == share


def test_the_extra_config_must_be_a_mapping():
    with pytest.raises(TypeError, match="kv_connector_extra_config: expected a mapping"):
        read_config([("cpu_bytes_to_use", BYTES)])


def test_a_whole_float_byte_count_builds_the_same_spec_as_the_int(tmp_path):
    rig = make_rig(tmp_path, extra={"cpu_bytes_to_use": float(BYTES)})
    try:
        assert rig.worker_spec.settings.cpu_bytes_to_use == BYTES
        assert rig.worker_spec.num_chunks == BYTES // rig.worker_spec._chunk_bytes
    finally:
        rig.close()


def test_a_missing_profile_path_fails_when_the_spec_is_built(tmp_path):
    missing = tmp_path / "nowhere.json"
    with pytest.raises(kv_vllm.ProfileNotFoundError, match="kvcopy_profile: no profile at") as caught:
        make_rig(tmp_path, extra={"kvcopy_profile": str(missing)})
    assert isinstance(caught.value, FileNotFoundError) and isinstance(caught.value, ValueError)


def test_a_profile_path_that_is_a_directory_is_named_a_directory(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"^kvcopy_profile: '.*profiles' is a directory; expected a profile's file"):
        read_config({"cpu_bytes_to_use": BYTES, "kvcopy_profile": str(folder)})
    assert list(folder.iterdir()) == []


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
