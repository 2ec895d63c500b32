"""The Python kernel's extra result formats (loaded with ``--IPKernelApp.extensions``), so
``Result.chart``, ``.data``, ``.json`` and ``.png`` come filled as users of E2B expect
(spec e2b-code-interpreter.md §3.3):

- ``e2b/chart``: a matplotlib figure as E2B's chart object (via PyPI ``e2b-charts`` when
  installed; ``{}`` if it cannot read the figure);
- ``e2b/data``: a pandas DataFrame as ``{column: [values]}`` (timestamps ISO);
- ``application/json``: a ``dict`` or ``list`` result also as JSON (when it is JSON-able);
- PIL: ``Image.show()`` displays the image (a PNG result) instead of looking for a viewer.

Classes are recognized by name, so nothing is imported until the user's own code has made
such an object."""
from __future__ import annotations

import json

from IPython.core.formatters import BaseFormatter
from traitlets import ObjectName, Unicode


class _ByTypeName(BaseFormatter):
    """A formatter of a custom MIME type (values: JSON objects) for the classes named in
    ``handles`` (top-level package, class name; subclasses too), looked up on every call:
    matplotlib's inline backend removes every formatter's registrations for ``Figure`` when
    it starts, which happens after this extension loads. (The package, not the module:
    pandas 3 says ``DataFrame.__module__ == "pandas"``, pandas 2 ``pandas.core.frame``.)"""

    print_method = ObjectName("_repr_aenv_unused_")
    _return_type = (dict,)
    handles: dict = {}

    def __call__(self, obj):
        for cls in type(obj).__mro__:
            func = self.handles.get((cls.__module__.partition(".")[0], cls.__name__))
            if func is not None:
                try:
                    return func(obj)
                except Exception:  # noqa: BLE001 - a format that fails is left out, never the result
                    return None
        return None


class ChartFormatter(_ByTypeName):
    format_type = Unicode("e2b/chart")
    handles = {("matplotlib", "Figure"): lambda figure: chart_of(figure)}


class DataFormatter(_ByTypeName):
    format_type = Unicode("e2b/data")
    handles = {("pandas", "DataFrame"): lambda frame: data_of(frame)}


def chart_of(figure) -> dict:
    try:
        from e2b_charts import chart_figure_to_dict
    except ImportError:
        return None
    try:
        return chart_figure_to_dict(figure) or {}
    except Exception:  # noqa: BLE001 - a figure the extractor cannot read: the PNG still comes
        return {}


def data_of(frame) -> dict | None:
    try:
        split = json.loads(frame.to_json(orient="split", date_format="iso"))
    except Exception:  # noqa: BLE001 - not JSON-able (objects in cells): no data format
        return None
    columns = [str(c) for c in split.get("columns", [])]
    rows = split.get("data", [])
    return {col: [row[i] for row in rows] for i, col in enumerate(columns)}


def json_of(obj):
    try:
        return json.loads(json.dumps(obj, allow_nan=False))
    except (TypeError, ValueError):
        return None


def _show(image, *args, **kwargs) -> None:
    from IPython.display import display

    display(image)


def load_ipython_extension(ip) -> None:
    formatters = ip.display_formatter.formatters
    formatters["e2b/chart"] = ChartFormatter(parent=ip.display_formatter)
    formatters["e2b/data"] = DataFormatter(parent=ip.display_formatter)
    formatters["application/json"].for_type(dict, json_of)
    formatters["application/json"].for_type(list, json_of)
    try:
        from PIL import Image
    except ImportError:
        return
    Image.Image.show = _show
