"""Build hook of the alias: refuse to build while a real vLLM distribution is installed.

pip builds in an isolated environment, so the check asks the installing interpreter itself
(`sys.executable -I`, which ignores PYTHONPATH) which `vllm` distribution it has. A `vllm`
whose summary does not start with "pagedlm alias" is a real vLLM: installing this alias
would uninstall it (same distribution name), so the build stops with a message instead.
Set PAGEDLM_VLLM_ALIAS_CHECK=0 only to build a wheel somewhere else.
"""

import os
import subprocess
import sys

from setuptools import setup

_PROBE = (
    "import importlib.metadata as m\n"
    "try:\n"
    "    d = m.distribution('vllm')\n"
    "except m.PackageNotFoundError:\n"
    "    print('none')\n"
    "else:\n"
    "    s = d.metadata.get('Summary') or ''\n"
    "    print('alias' if s.startswith('pagedlm alias') else 'real ' + d.version)\n"
)


def _check_no_real_vllm() -> None:
    if os.environ.get("PAGEDLM_VLLM_ALIAS_CHECK") == "0":
        return
    out = subprocess.run(
        [sys.executable, "-I", "-c", _PROBE], capture_output=True, text=True, check=True
    ).stdout.strip()
    if out.startswith("real"):
        raise SystemExit(
            f"Refusing to install pagedlm's `vllm` alias: a real vLLM ({out[5:]}) is installed "
            f"in {sys.prefix}. The alias would replace it. Use a separate virtual environment "
            "for pagedlm, or uninstall vLLM first."
        )


_check_no_real_vllm()
setup()
