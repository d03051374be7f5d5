"""The built extension is portable: the baseline clone of every CPU kernel uses no AVX registers.

GCC target_clones compiles each kernel for x86-64-v4 (AVX-512), x86-64-v3 (AVX2) and the baseline;
the loader picks one per CPU. A baseline clone touching ymm/zmm registers would crash on an older
x86-64, so we disassemble it. Skipped off x86-64 Linux, without objdump, or for a -march=native build.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

from torchstrategies import _ext


@pytest.mark.timeout(120)
@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"), reason="x86-64 Linux only")
@pytest.mark.skipif(shutil.which("objdump") is None or shutil.which("nm") is None, reason="binutils missing")
@pytest.mark.skipif(os.environ.get("TORCHSTRATEGIES_NATIVE") == "1", reason="-march=native build")
def test_default_clones_use_no_avx_registers() -> None:
    so = _ext._C.__file__
    # nm -S: address, size, type, name of every defined symbol; disassemble only the kernels: the six
    # instantiations of run_clones<T, Acc> (csrc/core/reduce_kernels.cpp), one per dtype, whose mangled
    # names carry the types (run_clonesIffE is <float, float>).
    nm = subprocess.run(["nm", "-S", "--defined-only", so], capture_output=True, text=True, timeout=60).stdout
    kernels: dict[str, tuple[int, int]] = {}
    for line in nm.splitlines():
        parts = line.split()
        if len(parts) == 4 and re.search(r"run_clonesI.*\.(default|arch_x86_64_v4)$", parts[3]):
            kernels[parts[3]] = (int(parts[0], 16), int(parts[1], 16))
    defaults = [f for f in kernels if f.endswith(".default")]
    wide = [f for f in kernels if f.endswith(".arch_x86_64_v4")]
    assert len(defaults) == 6 and len(wide) == 6, sorted(kernels)

    def disasm(name: str) -> str:
        start, size = kernels[name]
        cmd = ["objdump", "-d", "--no-show-raw-insn", f"--start-address={start:#x}",
               f"--stop-address={start + size:#x}", so]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout

    for f in defaults:
        bad = [ln for ln in disasm(f).splitlines() if re.search(r"%[yz]mm", ln)]
        assert not bad, f"{f} uses AVX registers: {bad[:3]}"
    # And the AVX-512 clone of the float32 kernel really is vectorized with zmm registers.
    f32 = next(f for f in wide if "run_clonesIffE" in f)
    assert "%zmm" in disasm(f32)
