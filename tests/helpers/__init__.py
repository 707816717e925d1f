"""What the tests share, imported by module (``from helpers.copies import check_copy``); conftest.py holds
only fixtures and hooks. Here: the facts of this machine the tests branch on, and the bounds a hang reaches.

- ``copies``: random caches of every engine layout, and a copy checked byte for byte against the reference;
- ``engines``: TransferEngines made by a test, and the gate that holds their CPU workers' copies;
- ``profiles``: Profiles built by hand, whose every prediction is known in advance;
- ``hf``: tiny random-weight transformers models and preempting workloads;
- ``vllm``: vLLM's real Scheduler and OffloadingConnector around CPU tensors;
- ``vllm_tiers``: the same with vLLM's stock TieringOffloadingSpec, its worker replaced by a CPU stand-in;
- ``remote``: a kvcopy peer in another process;
- ``netns``: a peer process in each of two network namespaces (``netns_peer`` is what runs there);
- ``storage``: disk stores and the pools they are filled from;
- ``docs``: the ```python blocks of the README and docs/*.md;
- ``exit_status``: a script run in a process of its own, to see how it ends.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Bounds that only a hang reaches, never a slow machine (the suite must hold at a load average of 10 on 2
# cores): ten times what the step they guard takes on the idle CI machine, rounded up. A held copy handed
# over between threads, a transfer, a peer's reply: under a second idle, 25 s for a peer process to start
# on a busy box.
HANG_TIMEOUT_S = 300.0
# A command a test runs: `kvcopy calibrate --quick` about 60 s idle, the device check's dry run and the
# benchmarks some minutes, an example or a kernel compile under a minute.
SUBPROCESS_TIMEOUT_S = 1800.0
# Every test this run collected, before -m or -k deselected any: (node id, marked slow); conftest.py fills it.
COLLECTED_TESTS = pytest.StashKey[list[tuple[str, bool]]]()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
gpu = pytest.mark.gpu

# Triton runs on CPU tensors only under its interpreter (conftest.py sets TRITON_INTERPRET=1 without a GPU).
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
# Methods that can run on a CPU <-> CPU pair in this process.
CPU_METHODS = ("torch", "cpu", "triton") if TRITON_ON_CPU else ("torch", "cpu")

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8)
