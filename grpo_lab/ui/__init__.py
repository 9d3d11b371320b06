"""Notebook widgets: the config editor, step controls and the panel that puts them beside the live plot."""

from .controls import StepControls
from .editor import ConfigEditor

__all__ = ["ConfigEditor", "StepControls", "Panel"]


class Panel:
    """`lab.ui()`: config editor and step controls side by side, the live memory plot below."""

    def __init__(self, lab):
        from .editor import _widgets

        w = _widgets()
        self.editor = ConfigEditor(lab.config, loaded=lambda: lab.learner is not None)  # edits lab.config in place
        self.controls = StepControls(lab)
        self.plot = lab.memory_plot() if lab.memory is not None and lab.learner is not None else None
        # why wrap: in a narrow notebook (1280 px, file browser open) the controls go under the editor, not over it
        from .live import PLOT_CSS

        style = w.HTML(value=PLOT_CSS, layout=w.Layout(display="none"))  # the plot follows the theme (live.PLOT_CSS)
        parts = [style, w.HBox([self.editor.widget, self.controls.widget], layout=w.Layout(flex_flow="row wrap"))]
        if self.plot is not None:
            parts.append(self.plot.fig)
        self.widget = w.VBox(parts)

    def _ipython_display_(self):
        from IPython.display import display

        if self.plot is not None:
            self.plot.refresh()
        display(self.widget)
