// The CPU backend runs each kernel from this handler rather than from
// jax.experimental.io_callback: XLA reports an io_callback's exception as
// "INTERNAL: CpuCallback error calling callback: Traceback ...", burying
// jaxtdist's error under a Python traceback, while an FFI handler returns the
// status code and message itself (the GPU handlers' form, e.g.
// "DEADLINE_EXCEEDED: jaxtdist.WaitTimeoutError: ...").
#include "ffi_host_kernel.h"

#include <Python.h>

#include <cstdint>
#include <string>
#include <utility>

namespace py = pybind11;
namespace ffi = xla::ffi;

namespace jaxtdist {
namespace {

// The dispatch function: a raw strong reference rather than a static
// py::object, whose destructor would run after Python is gone at exit. Read
// and written with the GIL held, which is what serializes the accesses.
PyObject* g_dispatch = nullptr;

// The status XLA reports for a name the dispatch function returns; names
// outside this list (a bug in the dispatcher) become kInternal.
ffi::ErrorCode CodeOfStatus(const std::string& name) {
  static const std::pair<const char*, ffi::ErrorCode> kCodes[] = {
      {"CANCELLED", ffi::ErrorCode::kCancelled},
      {"INVALID_ARGUMENT", ffi::ErrorCode::kInvalidArgument},
      {"DEADLINE_EXCEEDED", ffi::ErrorCode::kDeadlineExceeded},
      {"RESOURCE_EXHAUSTED", ffi::ErrorCode::kResourceExhausted},
      {"FAILED_PRECONDITION", ffi::ErrorCode::kFailedPrecondition},
      {"ABORTED", ffi::ErrorCode::kAborted},
      {"UNIMPLEMENTED", ffi::ErrorCode::kUnimplemented},
      {"UNAVAILABLE", ffi::ErrorCode::kUnavailable},
  };
  for (const auto& [n, code] : kCodes) {
    if (name == n) return code;
  }
  return ffi::ErrorCode::kInternal;
}

py::tuple AddressAndBytes(const ffi::AnyBuffer& buf) {
  return py::make_tuple(reinterpret_cast<std::uintptr_t>(buf.untyped_data()),
                        buf.size_bytes());
}

// (address, bytes) of each operand and result: Python knows their shapes and
// dtypes (it lowered the call), so plain addresses are all it needs to view
// them. ffi_lowering passes buffers only, so decoding cannot fail.
py::tuple Addresses(const ffi::RemainingArgs& args) {
  py::tuple out(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    out[i] = AddressAndBytes(args.get<ffi::AnyBuffer>(i).value());
  }
  return out;
}

py::tuple Addresses(const ffi::RemainingRets& rets) {
  py::tuple out(rets.size());
  for (size_t i = 0; i < rets.size(); ++i) {
    out[i] = AddressAndBytes(*rets.get<ffi::AnyBuffer>(i).value());
  }
  return out;
}

// "Type: message" of the Python error in flight, without its traceback: the
// status message must lead with what went wrong.
std::string Describe(const py::error_already_set& e) {
  std::string type = "Exception";
  std::string message;
  try {
    type = py::str(e.type().attr("__name__"));
    message = py::str(e.value());
  } catch (const py::error_already_set&) {
    // An exception whose str() raises: its type name alone.
  }
  return "jaxtdist host kernel: " + type + (message.empty() ? "" : ": " + message);
}

// The error for the dispatcher's answer: None is success, else (status, message).
ffi::Error ErrorOfAnswer(const py::object& answer) {
  if (answer.is_none()) return ffi::Error::Success();
  auto pair = answer.cast<py::tuple>();
  return ffi::Error(CodeOfStatus(pair[0].cast<std::string>()), pair[1].cast<std::string>());
}

ffi::Error HostKernel(ffi::RemainingArgs args, ffi::RemainingRets rets,
                      std::int64_t callback) {
  // A call that reaches a finalizing interpreter has nothing to run it.
  if (!Py_IsInitialized()) {
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      "jaxtdist.JaxtdistError: the Python interpreter is shutting down");
  }
  py::gil_scoped_acquire gil;
  if (g_dispatch == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jaxtdist.JaxtdistError: no host kernel dispatcher is set (a program "
                      "compiled in another process?); trace it again");
  }
  try {
    py::object answer = py::reinterpret_borrow<py::object>(g_dispatch)(
        callback, Addresses(args), Addresses(rets));
    return ErrorOfAnswer(answer);
  } catch (py::error_already_set& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, Describe(e));
  } catch (const std::exception& e) {  // a cast of a malformed answer
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jaxtdist host kernel: ") + e.what());
  }
}

}  // namespace

void SetHostKernelDispatch(py::handle dispatch) {
  PyObject* old = g_dispatch;
  g_dispatch = dispatch.inc_ref().ptr();
  Py_XDECREF(old);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxtdistHostKernelCpu, HostKernel,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<std::int64_t>("callback"));

}  // namespace jaxtdist
