"""Fallback `common_ops` for `sgl_kernel` on machines where its CUDA library cannot load.

Only on PYTHONPATH for agentloop's CPU SGLang servers; see agentloop/sglang_cpu/__init__.py.
Importing it registers the pure-torch CPU ops and the seeded-sampling patch in this process.
"""

from agentloop.inference.sglang_cpu.no_pin import install as _install_no_pin
from agentloop.inference.sglang_cpu.ops import register as _register
from agentloop.inference.sglang_cpu.seeded_sampling import (
    install as _install_seeded_sampling,
)

_register()
_install_seeded_sampling()
_install_no_pin()
