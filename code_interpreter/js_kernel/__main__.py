"""``python -m code_interpreter.js_kernel -f <connection file>``: the kernel's process."""
from ipykernel.kernelapp import IPKernelApp

from .kernel import JavaScriptKernel

if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=JavaScriptKernel)
