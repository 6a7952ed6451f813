"""ABI argument checks that need no GPU: every bad tensor is refused before anything is called."""

import ctypes
import warnings

import pytest
import torch

from kdev import abi
from kdev import build as kbuild
from kdev.config import load_suite
from kdev.cases import generate_case


@pytest.fixture(scope="module")
def case():
    spec = load_suite("smoke").cases[3]
    return generate_case(spec)


def _inputs(case, **override):
    x = abi.VerifyInputs.from_case(case.tensors, case.scale, "cpu")
    for k, v in override.items():
        setattr(x, k, v)
    n_q, h, _ = x.q.shape
    out = torch.empty(n_q, h, 512, dtype=torch.bfloat16)
    lse = torch.empty(n_q, h, dtype=torch.float32)
    return x, out, lse


def test_good_inputs_pass(case):
    x, out, lse = _inputs(case)
    assert abi.check_inputs(x, out, lse) == (x.q.shape[0], 8, 1)


@pytest.mark.parametrize("mutate, message", [
    (lambda x, o, l: setattr(x, "q", x.q.float()), "q: dtype torch.float32"),
    (lambda x, o, l: setattr(x, "q", x.q[..., :512].contiguous()), "q: rows are 512 wide"),
    (lambda x, o, l: setattr(x, "kv_cache", x.kv_cache.transpose(0, 1)), "kv_cache: not contiguous"),
    (lambda x, o, l: setattr(x, "page_table", x.page_table.long()), "page_table: dtype"),
    (lambda x, o, l: setattr(x, "q_indptr", x.q_indptr[:1]), "batch mismatch"),
    (lambda x, o, l: setattr(x, "tree_mask", x.tree_mask[1:]), "tree_mask: "),
    (lambda x, o, l: setattr(x, "q", torch.empty(x.q.numel() + 1, dtype=torch.bfloat16)[1:].view(x.q.shape)), "q: data pointer not 16-byte aligned"),
    (lambda x, o, l: setattr(x, "prefix_lens", x.prefix_lens.to("meta")), "prefix_lens: on meta"),
])
def test_bad_inputs_refused(case, mutate, message):
    x, out, lse = _inputs(case)
    mutate(x, out, lse)
    with pytest.raises(abi.AbiArgumentError, match=message.replace("(", r"\(").replace("[", r"\[")):
        abi.check_inputs(x, out, lse)


def test_bad_outputs_refused(case):
    x, out, lse = _inputs(case)
    with pytest.raises(abi.AbiArgumentError, match="out: shape"):
        abi.check_inputs(x, out[:, :4].contiguous(), lse)
    with pytest.raises(abi.AbiArgumentError, match="lse: dtype"):
        abi.check_inputs(x, out, lse.double())


def test_params_struct_matches_library_and_cpu_tensors_refused(case, sm90_library):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # built from the current sources: no stale warning
        lib = abi.Library(sm90_library)
    assert lib.lib.kdtree_params_size() == ctypes.sizeof(lib.structs["VerifyAttnParams"]) and lib.max_qlen == 1025
    x, out, lse = _inputs(case)
    with pytest.raises(abi.AbiArgumentError, match="q: must be a CUDA tensor"):
        lib.params(x, out, lse)
    with pytest.raises(abi.AbiArgumentError, match="unknown verify kernel"):
        lib.call("fastest", lib.make("VerifyAttnParams"))


def test_library_without_an_entry_point_loads_and_refuses_that_kernel(monkeypatch, sm90_library):
    """A library built before an entry point existed (an A/B base) still loads; only calling the missing kernel is
    refused, with one line naming it. The current library has every verify kernel."""
    assert abi.Library(sm90_library).kernels == tuple(abi.VERIFY_KERNELS)
    monkeypatch.setitem(abi.VERIFY_KERNELS, "flash-next", "kdtree_verify_attn_flash_next")
    lib = abi.Library(sm90_library)
    assert "flash-next" not in lib.kernels and "flash-portable" in lib.kernels
    with pytest.raises(abi.AbiArgumentError, match="has no flash-next kernel .* older sources"):
        lib.call("flash-next", lib.make("VerifyAttnParams"))


def test_plan_as_another_gpu_needs_a_params_struct_with_plan_sm_count(sm90_library):
    """plan_as(N) puts N into every call's params.plan_sm_count; a library whose own header has no such field (ABI 1,
    whose field of that place was `reserved` and ignored) would plan for this GPU regardless, so asking it is refused,
    not silently dropped."""
    lib = abi.Library(sm90_library)
    assert lib.plan_sm_count == 0
    lib.plan_as(188)
    assert lib.plan_sm_count == 188
    with pytest.raises(abi.AbiArgumentError, match="plan_sm_count -1 < 0"):
        lib.plan_as(-1)
    fields = [f for f in lib.structs["VerifyAttnParams"]._fields_ if f[0] != "plan_sm_count"]
    lib.structs = {**lib.structs, "VerifyAttnParams": type("VerifyAttnParams", (ctypes.Structure,),
                                                           {"_fields_": fields})}
    from kdev.errors import EnvironmentMissing

    with pytest.raises(EnvironmentMissing, match="has no plan_sm_count"):
        lib.plan_as(188)
    lib.plan_as(0)  # this GPU's own plan: every ABI
    assert not hasattr(lib.make("VerifyAttnParams", batch=1, plan_sm_count=0), "plan_sm_count")


def test_stale_library_warns(monkeypatch, sm90_library):
    monkeypatch.setattr(kbuild, "source_hash", lambda *a: "f" * 64)
    with pytest.warns(abi.StaleLibraryWarning, match="run 'kdev build'"):
        abi.Library(sm90_library)


def test_a_library_not_built_is_environment_and_one_named_wrongly_is_bad_input(tmp_path, monkeypatch):
    from kdev.errors import BadInput, EnvironmentMissing

    monkeypatch.setattr(abi.kbuild, "latest_library", lambda *a: None)
    with pytest.raises(EnvironmentMissing, match=r"no library of sm_90a, sm_120 built .*an --arch build is not"):
        abi.Library()
    with pytest.raises(BadInput, match="no such library"):
        abi.Library(tmp_path / "nope.so")
    (tmp_path / "not-a-library.so").write_text("text")
    with pytest.raises(EnvironmentMissing, match="does not load"):
        abi.Library(tmp_path / "not-a-library.so")


def test_load_library_reuses_a_current_build_for_this_arch(monkeypatch, sm90_library):
    from types import SimpleNamespace

    from kdev import gpu

    monkeypatch.setattr(kbuild, "latest_library", lambda *a, **k: sm90_library)
    monkeypatch.setattr(gpu, "current_arch", lambda: "sm_90")
    built = []
    monkeypatch.setattr(kbuild, "build", lambda cfg, log=None: built.append(cfg.archs) or SimpleNamespace(
        problems=[], library=sm90_library))
    assert abi.load_library().path == sm90_library and built == []
    monkeypatch.setattr(gpu, "current_arch", lambda: "sm_100")  # the last build (sm_90, sm_120) lacks this GPU's arch
    assert abi.load_library().path == sm90_library and built == [("sm_100",)]


def test_load_library_takes_an_arch_specific_build_for_its_gpu(monkeypatch, tmp_path):
    """kdev build --arch sm_90a on an sm_90 GPU (its wgmma kernels): the library every command then loads, with no
    build of plain sm_90 made beside it."""
    from types import SimpleNamespace

    from kdev import gpu

    specific = tmp_path / "libkdtree.so"
    monkeypatch.setattr(kbuild, "latest_library", lambda output_dir=None, archs=None:
                        specific if archs == ["sm_90a"] else None)
    monkeypatch.setattr(gpu, "current_arch", lambda: "sm_90")
    monkeypatch.setattr(abi, "Library", lambda p: SimpleNamespace(path=p, stale=False,
                                                                  build_info={"archs": ["sm_90a"]}))
    monkeypatch.setattr(kbuild, "build", lambda cfg, log=None: pytest.fail(f"built {cfg.archs}"))
    assert abi.load_library().path == specific
