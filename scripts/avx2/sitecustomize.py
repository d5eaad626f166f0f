"""Loaded by every Python process of ``scripts/test-as-avx2.sh``: OpenVINO as it behaves on an AVX2-only CPU.

Its CPU plugin keeps bf16 for CPUs where oneDNN may use AVX-512 or AVX2-VNNI-2 (``precision_support.cpp``)
and otherwise takes a bf16 ``INFERENCE_PRECISION_HINT`` and computes in f32. ``ONEDNN_MAX_CPU_ISA=AVX2`` does not
reach that check (the plugin still compiles bf16, then finds no bf16 kernel for Softmax), so the hint is replaced
here, when OpenVINO is first imported, as the plugin does on such a CPU.
"""

import importlib.abc
import importlib.machinery
import sys


def _compute_bf16_in_f32(openvino) -> None:
    compile_model = openvino.Core.compile_model

    def compile_without_bf16(self, model, device_name=None, config=None, *args, **kwargs):
        if isinstance(config, dict) and str(config.get("INFERENCE_PRECISION_HINT", "")).lower() in ("bf16", "bfloat16"):
            config = {**config, "INFERENCE_PRECISION_HINT": "f32"}
        return compile_model(self, model, device_name, config, *args, **kwargs)

    openvino.Core.compile_model = compile_without_bf16


class _OnOpenVINOImport(importlib.abc.MetaPathFinder):
    """Patches ``openvino`` once it has loaded; a process that never imports it pays nothing."""

    def find_spec(self, name, path, target=None):
        if name != "openvino":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _compute_bf16_in_f32(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _OnOpenVINOImport())
