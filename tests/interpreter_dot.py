"""The Triton interpreter's ``tl.dot`` with one rounding, so CPU results do not depend on the host.

The interpreter computes ``tl.dot`` with ``numpy.matmul``, that is the host's BLAS: its fp32
summation order, and so its error, differs between CPUs (an AVX2-only OpenBLAS kernel sums a
64-term dot with up to twice the error of an AVX-512 one), and neither is a GPU's MMA. For the
tests, an fp32-output dot of fp16 / fp32 operands is summed in fp64 (the products are exact) with
the accumulator and rounded once: the kernels' results then depend on their algorithm alone, on
every host. Other operand types (the interpreter's raw-bit bf16, fp64, ints) keep Triton's own path.
"""
import numpy as np

_EXACT_OPERANDS = (np.dtype(np.float16), np.dtype(np.float32))


def install() -> None:
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_one_rounding", False):
        return
    triton_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if (d.data.dtype != np.float32 or a.data.dtype not in _EXACT_OPERANDS
                or b.data.dtype not in _EXACT_OPERANDS):
            return triton_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)) + d.data.astype(np.float64)
        return interpreter.TensorHandle(acc.astype(np.float32), d.dtype.scalar)

    create_dot._one_rounding = True
    builder.create_dot = create_dot
