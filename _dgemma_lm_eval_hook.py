"""Makes ``lm_eval --model dgemma`` work: lm-eval 0.4.13 resolves ``--model`` only against models
registered in its own process and has no plugin mechanism (no entry points), so dgemma's
installation adds ``dgemma-lm-eval.pth``, which imports this module at interpreter start-up.

It costs one small import and does nothing else until a process imports ``lm_eval.models`` (the
package whose import registers the harness's own models). Right after that import it registers
``dgemma`` as a lazy ``"dgemma.lm_eval_model:DGemmaLM"`` entry, so neither dgemma nor torch is
imported until a run asks for ``--model dgemma``. Any failure here is swallowed: a broken hook
must never break an unrelated Python process. See docs/guides/lm-eval.md.
"""

import sys

_WATCHED = "lm_eval.models"
_TARGET = "dgemma.lm_eval_model:DGemmaLM"


def _register() -> None:
    try:
        from lm_eval.api.registry import model_registry

        if "dgemma" not in model_registry:
            model_registry.register("dgemma", target=_TARGET)
    except Exception:  # an lm-eval without this registry API: `dgemma lm-eval` still works
        pass


class _Finder:
    """A meta-path finder that only wraps the loader of ``lm_eval.models``."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != _WATCHED:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_and_register
        return spec


def install() -> None:
    if _WATCHED in sys.modules:  # already imported (the hook was installed late): register now
        _register()
    elif not any(f is _Finder for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder)


install()
