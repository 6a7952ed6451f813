"""kdev plan on the GPU: the plan for the GPU here (from its device properties) is the one its flash launches take."""

import pytest
import torch

from kdev import bench
from kdev import plan as kplan

pytestmark = pytest.mark.gpu


def test_the_plan_here_is_what_the_launch_takes(lib):
    here = kplan.gpu_here()
    assert here is not None and here.arch == "sm_%d%d" % torch.cuda.get_device_capability()
    planner = kplan.PlanLibrary(lib.path)
    cfg = bench.load_bench()
    shapes = bench.expand(cfg, "targets", None, None) + bench.expand(cfg, None, ["B=3,L=5000,N=16,H=16,page=1"], None)
    for shape in shapes:
        x, sizes, _ = bench.make_inputs(shape, seed=1, device="cuda")
        assert max(sizes) == shape.T
        out, lse = lib.alloc_outputs(x)
        p = lib.params(x, out, lse)
        planned = kplan.plan_shape(planner, shape, here)
        assert (planned.splits, planned.workspace_bytes) == (lib.flash_splits(p), lib.workspace_size(p)), shape.name
        del x, out, lse
