"""Everything is in pyproject.toml but one file: ``dgemma-lm-eval.pth``, which has to sit at the
top of site-packages (pyproject metadata cannot put it there). It imports ``_dgemma_lm_eval_hook``
at start-up so that lm-eval's own command finds ``--model dgemma`` (docs/guides/lm-eval.md)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "dgemma-lm-eval.pth"


class build_py_with_pth(build_py):
    """Puts the .pth beside the packages: in ``build_lib`` for a wheel, and for an editable install
    (``pip install -e``, whose wheel holds no package files) straight into the wheel's root, where
    setuptools' editable build points ``install_lib``."""

    def run(self):
        super().run()
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(root) / PTH))


setup(cmdclass={"build_py": build_py_with_pth})
