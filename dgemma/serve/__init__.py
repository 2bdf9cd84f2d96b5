"""The playground: a local web app that streams the denoising of Sudoku boards and text canvases.

``dgemma serve`` (``dgemma/cli/serve.py``) builds the app with :func:`dgemma.serve.app.create_app`;
the page itself lives in ``dgemma/serve/static/``. See ``docs/playground.md``. The same app
answers OpenAI-compatible requests under ``/v1`` (``dgemma/serve/openai_api.py``,
``docs/guides/serving.md``).
"""
