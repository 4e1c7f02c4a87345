// The CPU backend's kernel launch: an XLA FFI handler that calls back into
// Python (the interpreter workers are driven from Python) and turns a Python
// error into an XLA status naming jaxtdist's error, as the GPU handlers do.
#ifndef JAXTDIST_CSRC_FFI_HOST_KERNEL_H_
#define JAXTDIST_CSRC_FFI_HOST_KERNEL_H_

#include <pybind11/pybind11.h>

#include "xla/ffi/api/ffi.h"

namespace jaxtdist {

// Sets the Python function every host kernel call goes through (the GIL must
// be held):
//   dispatch(callback_id, args, rets) -> None | (status_name, message)
// args and rets are tuples of (address, bytes) of the call's XLA buffers; the
// function returns None on success, or an absl status name ("DEADLINE_EXCEEDED",
// ...) and the message for the error XLA reports. Replaces any earlier one.
void SetHostKernelDispatch(pybind11::handle dispatch);

// Operands: any buffers; results: any buffers; attribute callback (int64):
// the id the dispatch function resolves to a Python callable.
extern "C" XLA_FFI_Error* JaxtdistHostKernelCpu(XLA_FFI_CallFrame* call_frame);

}  // namespace jaxtdist

#endif  // JAXTDIST_CSRC_FFI_HOST_KERNEL_H_
