"""The ops' argument checks, for code built on the ops (the reference trainer, users' own models).

Same contract as the ops: every check raises before anything is written, ``TypeError`` for a
wrong Python type and ``ValueError`` for a wrong shape, dtype, device or content, with a
message naming the argument.

* :func:`check_tensor` ``(name, t, *, ndim, dtypes, device, shape)`` - a tensor argument;
* :func:`check_int` / :func:`check_float` / :func:`check_flag` - Python scalars (bool is not a number);
* :func:`check_float_or_tensor` - a number that may also come as a 1-element tensor, whose value is
  checked on the device without a host sync (a ``RuntimeError`` from ``torch._assert_async``);
* :func:`check_cu_seqlens` ``(cu_seqlens, total_tokens)`` - packed-sequence boundaries (one host sync);
* :func:`to_device_checked` ``(t, device)`` - copy host-built integer data (ids, labels, ``cu_seqlens``)
  to the device with its checked facts, so the ops' checks of the copy read nothing;
* :func:`check_mask` ``(name, mask, *, ndim, device, shape)`` - a token mask (bool, integer or float
  0 / 1; a float mask's values checked on the device) returned as bool;
* ``FLOAT_DTYPES`` / ``INT_DTYPES`` / ``MASK_DTYPES`` - the dtypes the ops accept for floats / integer
  ids / masks.
"""
from ._validation import (FLOAT_DTYPES, INT_DTYPES, MASK_DTYPES, check_cu_seqlens, check_flag, check_float,
                          check_float_or_tensor, check_int, check_mask, check_tensor, to_device_checked)

__all__ = ["check_tensor", "check_int", "check_float", "check_flag", "check_float_or_tensor", "check_cu_seqlens",
           "check_mask", "to_device_checked", "FLOAT_DTYPES", "INT_DTYPES", "MASK_DTYPES"]
