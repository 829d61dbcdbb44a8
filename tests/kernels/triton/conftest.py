"""Run the Triton kernels on CPU tensors through Triton's interpreter.

``triton.jit`` decides between compiling and interpreting when a kernel is defined, so the flag must be set
before ``kernels.triton_ops`` is first imported; setting it here, before any test module of this folder is
collected, does that.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
