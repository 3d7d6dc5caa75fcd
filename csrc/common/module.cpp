// Makes _C importable as a Python module; importing it runs the op registrations. Its Python
// functions: the tuning command's _set_tuning_override(name, value or None), and the in-place
// modules' _sole_tensor_owner(tensor).
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <string>

namespace mti {
void set_tuning_override(const std::string& name, const int64_t* value);
}

namespace {

PyObject* set_tuning_override(PyObject*, PyObject* args) {
  const char* name = nullptr;
  PyObject* value = nullptr;
  if (!PyArg_ParseTuple(args, "sO:_set_tuning_override", &name, &value)) return nullptr;
  if (value == Py_None) {
    mti::set_tuning_override(name, nullptr);
    Py_RETURN_NONE;
  }
  const long long v = PyLong_AsLongLong(value);
  if (v == -1 && PyErr_Occurred()) return nullptr;
  const int64_t v64 = v;
  mti::set_tuning_override(name, &v64);
  Py_RETURN_NONE;
}

// True when nothing on the C++ side reaches the tensor's memory but this tensor: its TensorImpl
// has no other owner (an autograd node that saved it, C++ code holding it), and no other
// TensorImpl shares its storage (a view of it, .detach(), a saved output's data, a Python
// storage object), except, for a view, its base where only this view holds that base (F.linear
// returns its 3-D output as a view of the 2-D GEMM result; a base that Python has seen keeps its
// Python object, which counts as a holder). The in-place modules overwrite their input only
// then; Python references are counted separately (make_torch_inplace/_call_site.py).
bool sole_owner(const at::Tensor& t) {
  if (!t.defined() || t.use_count() != 1 || !t.has_storage()) return false;
  if (!t.is_view()) return t.storage().use_count() == 1;
  const at::TensorBase& base = t._base();
  return base.use_count() == 1 && t.storage().use_count() == 2;
}

PyObject* sole_tensor_owner(PyObject*, PyObject* arg) {
  if (!THPVariable_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "_sole_tensor_owner: expected a Tensor, got %s",
                 Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  return PyBool_FromLong(sole_owner(THPVariable_Unpack(arg)));
}

PyMethodDef methods[] = {
    {"_set_tuning_override", set_tuning_override, METH_VARARGS,
     "Overrides a tuned kernel parameter for this process (None removes the override)."},
    {"_sole_tensor_owner", sole_tensor_owner, METH_O,
     "True when no other tensor, view, base, storage object or C++ owner reaches the tensor's "
     "memory."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
}
