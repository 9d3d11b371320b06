"""The CUDA paths CPU CI cannot run (bench/gpu/gpu_smoke.py): on a GPU each is a `gpu` test here; on this CPU the smoke
itself must exit 0 with every path skipped and the reason said."""

from __future__ import annotations

import pytest
import torch

from bench.gpu import gpu_smoke


def test_the_smoke_on_a_cpu_skips_every_path_with_its_reason(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the gpu tests below run the paths")
    assert gpu_smoke.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(gpu_smoke.PATHS)
    for line, name in zip(lines, gpu_smoke.PATHS):
        assert line.startswith(name) and " skipped  no CUDA device here" in line, line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(gpu_smoke.PATHS))
def test_cuda_path(name):
    try:
        print(gpu_smoke.PATHS[name]())
    except gpu_smoke.Skip as why:
        pytest.skip(str(why))
