"""A Triton kernel that fails to compile or launch raises a KernelError naming the kernel, the shapes, the
dtype and how to choose another backend; and the default backend per kind on CUDA comes from one table.

The failure is forced by making Triton's launch raise ``OutOfResources`` (what a launch over the GPU's
shared-memory limit raises) before any kernel body runs, so these tests are fast in the interpreter.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")

from hf_posenc.kernels import defaults  # noqa: E402
from hf_posenc.kernels._errors import KernelError  # noqa: E402
from hf_posenc.kernels.attention import KernelTerm  # noqa: E402


def _out_of_shared_memory(monkeypatch) -> None:
    """Every Triton launch (interpreted or compiled) fails as a launch over the shared-memory limit does."""
    from triton.runtime.errors import OutOfResources
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def fail(self, *args, **kwargs):
        raise OutOfResources(262144, 232448, "shared memory")

    monkeypatch.setattr(InterpretedFunction, "run", fail)
    monkeypatch.setattr(JITFunction, "run", fail)


def _qkv(dtype=torch.bfloat16, b=1, h=4, hkv=2, lq=20, lk=20, d=40):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, lq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    return q, k, v


def _check(err: KernelError, kernel: str, family: str, dtype: torch.dtype, shape: tuple) -> None:
    msg = str(err)
    assert kernel in msg and f"({family})" in msg
    assert str(tuple(shape)) in msg
    assert str(dtype) in msg
    assert "HF_POSENC_BACKEND=torch" in msg
    assert "shared memory" in msg  # the cause's first line
    assert err.__cause__ is not None and type(err.__cause__).__name__ == "OutOfResources"


def test_attention_kernel_failure_names_kernel_shapes_dtype_and_backend(monkeypatch):
    from hf_posenc.kernels.attention.triton_attention import fused_attention

    _out_of_shared_memory(monkeypatch)
    q, k, v = _qkv()
    with pytest.raises(KernelError) as info:
        fused_attention(q, k, v, KernelTerm.alibi(torch.rand(4)), scale=0.1, causal=True)
    _check(info.value, "_fwd_kernel", "attention", torch.bfloat16, q.shape)
    assert "term=alibi" in str(info.value) and "HF_POSENC_BACKEND=flex" in str(info.value)


def test_sba_kernel_failure_names_kernel_shapes_dtype_and_backend(monkeypatch):
    from hf_posenc.kernels.sba.triton_sba import sba_triton

    _out_of_shared_memory(monkeypatch)
    q, k, v = _qkv(torch.float16)
    with pytest.raises(KernelError) as info:
        sba_triton(q, k, v, None, 0.1, 0)
    _check(info.value, "_sba_fwd", "sba", torch.float16, q.shape)


def test_cope_kernel_failure_names_kernel_shapes_dtype_and_backend(monkeypatch):
    from hf_posenc.kernels.cope.triton_cope import cope_triton

    _out_of_shared_memory(monkeypatch)
    q, k, v = _qkv(torch.float32, d=128)
    with pytest.raises(KernelError) as info:
        cope_triton(q, k, v, torch.randn(128, 16), None, 0.1, 0)
    _check(info.value, "_cope_fwd", "cope", torch.float32, q.shape)


def test_rotary_kernel_failure_names_kernel_shapes_dtype_and_backend(monkeypatch):
    from hf_posenc.kernels.rotary.triton_rotary import rotary_qk

    _out_of_shared_memory(monkeypatch)
    q, k, _ = _qkv(d=8)
    rot = torch.eye(2).expand(1, 1, 20, 4, 2, 2).contiguous()
    with pytest.raises(KernelError) as info:
        rotary_qk(q, k, rot)
    _check(info.value, "_rotary_qk_kernel", "rotary", torch.bfloat16, k.shape)


def test_backward_kernel_failure_is_named_too(monkeypatch):
    """A failure in a backward kernel names that kernel (the forward ran)."""
    from triton.runtime.errors import OutOfResources
    from triton.runtime.interpreter import InterpretedFunction

    from hf_posenc.kernels.attention import triton_attention as ta

    if not ta.interpreting():
        pytest.skip("runs the forward in Triton's interpreter")
    real = InterpretedFunction.run

    def fail_backward(self, *args, **kwargs):
        if self.fn.__name__.startswith("_bwd"):
            raise OutOfResources(200000, 166912, "shared memory")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", fail_backward)
    q, k, v = (t.requires_grad_() for t in _qkv(torch.float32, lq=8, lk=8, d=16))
    out = ta.fused_attention(q, k, v, KernelTerm.none(), scale=0.25, causal=True)
    with pytest.raises(KernelError, match=r"_bwd_delta_kernel .*float32"):
        out.sum().backward()


# -- defaults: one table ----------------------------------------------------------------------------


def test_default_table_covers_every_kind_and_every_encodings_kinds_agree():
    import hf_posenc
    from hf_posenc.kernels.attention.terms import TERM_KINDS
    from hf_posenc.registry import get_encoding

    assert set(defaults.CUDA_DEFAULT_BACKEND) == set(TERM_KINDS) | {"sba", "cope", "rotary", "remap"}
    for name in hf_posenc.list_encodings():
        kinds = tuple(getattr(get_encoding(name).cls, "kernel_kinds", ()))
        if kinds:
            assert defaults.cuda_default_backend(kinds) in ("triton", "flex", "torch")


def test_default_table_rejects_bad_entries():
    with pytest.raises(ValueError, match="shaw can run on triton, torch"):
        defaults._validate({**defaults.CUDA_DEFAULT_BACKEND, "shaw": "flex"})
    with pytest.raises(ValueError, match="unknown kernel kind"):
        defaults.cuda_default_backend("nope")
    table = {**defaults.CUDA_DEFAULT_BACKEND, "kerple_pow": "flex"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(defaults, "CUDA_DEFAULT_BACKEND", table)
        with pytest.raises(ValueError, match="different backends"):
            defaults.cuda_default_backend(("kerple_log", "kerple_pow"))


def test_dispatchers_read_the_table(monkeypatch):
    """attention_backend (bias terms), choose (sba, cope) and rotation_backend read the one table."""
    from hf_posenc import attention as attention_module
    from hf_posenc.kernels import _attn_dispatch
    from tests.conftest import make_model

    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    enc = make_model("llama", encoding="alibi").model.posenc
    unmeasured = attention_module.attention_backend(enc, "cuda")
    assert unmeasured == ("triton" if attention_module._attention_triton_error() is None else "torch")
    for choice in ("flex", "torch"):
        monkeypatch.setitem(defaults.CUDA_DEFAULT_BACKEND, "alibi", choice)
        assert attention_module.attention_backend(enc, "cuda") == choice
    assert attention_module.attention_backend(enc, "cpu") == "torch"

    assert _attn_dispatch.choose(lambda: None, True, "sba") == "triton"
    monkeypatch.setitem(defaults.CUDA_DEFAULT_BACKEND, "sba", "torch")
    assert _attn_dispatch.choose(lambda: None, True, "sba") == "torch"
    assert _attn_dispatch.choose(lambda: None, True, "cope") == "triton"
    monkeypatch.setenv("HF_POSENC_BACKEND", "triton")  # forcing still wins over the table
    assert _attn_dispatch.choose(lambda: None, True, "sba") == "triton"


# -- a kernel module that fails to import is an error, never "no Triton" ---------------------------------

_ATTENTION_MODULE = "hf_posenc.kernels.attention.triton_attention"


class _FailingImport:
    """A meta-path finder under which importing ``name`` raises ``exc`` (as a broken module or install would)."""

    def __init__(self, name: str, exc: BaseException) -> None:
        self.name, self.exc = name, exc

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise self.exc
        return None


def _fail_import(monkeypatch, name: str, exc: BaseException) -> None:
    """Importing ``name`` raises ``exc`` for the rest of the test; the import probe's cache starts empty."""
    import sys

    from hf_posenc.kernels import _common

    monkeypatch.setattr(_common, "_IMPORT_ERRORS", {})
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingImport(name, exc), *sys.meta_path])


def _alibi_encoding():
    from tests.conftest import make_model

    return make_model("llama", encoding="alibi").model.posenc


def test_a_broken_kernel_module_raises_where_it_is_used(monkeypatch):
    """Triton installed, our attention kernel module raising ImportError("boom"): the unforced CUDA dispatch and
    the kernel's own check raise a KernelImportError naming the module (the probe used to answer "no Triton", and
    an unforced model on CUDA ran the PyTorch engine silently); forcing torch never asks."""
    from hf_posenc import attention as attention_module
    from hf_posenc.kernels._errors import KernelImportError
    from hf_posenc.kernels.attention import kernel_unsupported

    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    enc = _alibi_encoding()
    _fail_import(monkeypatch, _ATTENTION_MODULE, ImportError("boom"))
    for _ in range(2):  # the first answer and the cached one
        match = f"{_ATTENTION_MODULE} failed to import .*ImportError: boom"
        with pytest.raises(KernelImportError, match=match) as info:
            attention_module.attention_backend(enc, "cuda")
        assert isinstance(info.value.__cause__, ImportError) and "HF_POSENC_BACKEND=torch" in str(info.value)
    q, k, v = _qkv(torch.float32)
    with pytest.raises(KernelImportError, match=_ATTENTION_MODULE):
        kernel_unsupported(q, k, v, KernelTerm.alibi(torch.rand(4)))
    assert attention_module.attention_backend(enc, "cpu") == "torch"  # no kernel on the CPU: nothing imported
    monkeypatch.setenv("HF_POSENC_BACKEND", "torch")
    assert attention_module.attention_backend(enc, "cuda") == "torch"


@pytest.mark.parametrize("module,ask", [
    ("cope.triton_cope", "cope"), ("sba.triton_sba", "sba"), ("rotary.triton_rotary", "rotary")])
def test_every_dispatch_raises_for_its_broken_module(monkeypatch, module, ask):
    """The CoPE and stick-breaking dispatch (unforced, CUDA) and the rotary kernel's check, each for its module;
    any exception, not only an ImportError."""
    from hf_posenc.kernels import _attn_dispatch
    from hf_posenc.kernels._errors import KernelImportError

    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    _fail_import(monkeypatch, f"hf_posenc.kernels.{module}", AttributeError("module 'triton.language' has no x"))
    q, k, v = _qkv(torch.float32)
    with pytest.raises(KernelImportError, match=f"hf_posenc.kernels.{module} failed .*AttributeError"):
        if ask == "rotary":
            from hf_posenc.kernels.rotary import _kernel_unsupported

            _kernel_unsupported(q, k, 2)
        else:
            def reason():
                return _attn_dispatch.common_unsupported(ask, module, q, k, v, None, 0, False, 0.0, False)

            _attn_dispatch.choose(reason, True, ask)
    with pytest.raises(KernelImportError, match=f"hf_posenc.kernels.{module}"):
        _attn_dispatch.kernel_preferred(ask, module, torch.device("cuda"))


def test_a_broken_kernel_module_raises_under_compile(monkeypatch):
    """A compiled forward asks the probe while it is traced (`_constant_import_error`): the error comes out of
    torch.compile too, naming the module, instead of a graph that runs the PyTorch engine."""
    from hf_posenc import attention as attention_module

    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    enc = _alibi_encoding()
    _fail_import(monkeypatch, _ATTENTION_MODULE, ImportError("boom"))
    torch._dynamo.reset()

    def pick(x):
        return x + (1.0 if attention_module.attention_backend(enc, "cuda") == "triton" else -1.0)

    with pytest.raises(Exception, match=_ATTENTION_MODULE):
        torch.compile(pick, fullgraph=True, backend="eager")(torch.zeros(2))
    torch._dynamo.reset()


def test_a_broken_kernel_module_fails_the_doctor(monkeypatch, tmp_path):
    """``hf-posenc doctor``: every Triton row of a broken module is an error naming it; the exit status is 1."""
    import json

    from hf_posenc import cli

    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    _fail_import(monkeypatch, _ATTENTION_MODULE, ImportError("boom"))
    out = tmp_path / "r.json"
    code = cli.main(["doctor", "--device", "cpu", "--engines", "triton,tiled", "--cases", "alibi", "--no-timing",
                     "--no-progress", "--out", str(out)])
    data = json.loads(out.read_text())
    assert code == 1 and data["ok"] is False
    rows = {r["engine"]: r for r in data["rows"]}
    assert rows["tiled"]["status"] == "pass"
    assert rows["triton"]["status"] == "error" and f"{_ATTENTION_MODULE} failed to import" in rows["triton"]["note"]
    assert "boom" in rows["triton"]["note"]


def test_missing_triton_is_no_triton(monkeypatch):
    """``import triton`` failing because the package is missing (None in sys.modules: what Python does for an
    absent package) is the one case that means "no Triton": the unforced dispatch picks the PyTorch engine, the
    kernel's check says to install Triton, as before."""
    import sys

    from hf_posenc import attention as attention_module
    from hf_posenc.kernels import _common
    from hf_posenc.kernels.attention import kernel_unsupported

    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    enc = _alibi_encoding()
    monkeypatch.setattr(_common, "_IMPORT_ERRORS", {})
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, _ATTENTION_MODULE, raising=False)
    assert attention_module.attention_backend(enc, "cuda") == "torch"
    q, k, v = _qkv(torch.float32)
    why = kernel_unsupported(q, k, v, KernelTerm.alibi(torch.rand(4)))
    assert why.startswith("Triton is not available (ModuleNotFoundError") and "pip install hf_posenc[triton]" in why


def test_a_broken_triton_is_not_no_triton(monkeypatch):
    """Triton installed but ``import triton`` raising (a broken install): an error naming Triton and the kernel
    module that needed it, not "no Triton"."""
    from hf_posenc import attention as attention_module
    from hf_posenc.kernels._errors import KernelImportError

    monkeypatch.delenv("HF_POSENC_BACKEND", raising=False)
    enc = _alibi_encoding()
    _fail_import(monkeypatch, "triton", ImportError("libtriton.so: cannot open shared object file"))
    with pytest.raises(KernelImportError, match=f"`import triton` failed .*libtriton.so.*{_ATTENTION_MODULE}"):
        attention_module.attention_backend(enc, "cuda")
