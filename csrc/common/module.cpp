// Makes _C importable as a Python module; importing it runs the op registrations. Its one
// Python function is the tuning command's: _set_tuning_override(name, value or None).
#include <Python.h>

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

PyMethodDef methods[] = {
    {"_set_tuning_override", set_tuning_override, METH_VARARGS,
     "Overrides a tuned kernel parameter for this process (None removes the override)."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
}
