"""Building blocks shared by kvcanary's dashboards: the data source, variables, panels and the grid.

Every panel and every query reads from the ``datasource`` template variable, a data source picker
limited to Prometheus whose default is the uid ``prometheus`` that
``dashboards/provisioning/datasources.yml`` provisions. A Grafana whose Prometheus has another uid
still works: pick it in the drop-down (or ``?var-datasource=<uid>``), with no JSON edited.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from grafana_foundation_sdk.builders import common, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders.dashboard import (
    AnnotationQuery,
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

#: The data source every panel uses: whatever the ``datasource`` variable holds.
DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
#: The uid the provisioned Prometheus data source has, and the variable's default.
DEFAULT_DATASOURCE_UID = "prometheus"
GRID_COLUMNS = 24

# Colours by meaning, so a leak is the same red on every panel.
RED, ORANGE, YELLOW, GREEN, BLUE = "red", "orange", "yellow", "green", "blue"
Step = tuple[str, float | None]
P = TypeVar("P", timeseries.Panel, stat.Panel, table.Panel)


def standard_dashboard(uid: str, title: str, description: str) -> Dashboard:
    """Return a dashboard with kvcanary's defaults: tags, time range, refresh, links to its siblings."""
    return (
        Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["kvcanary"])
        .timezone("browser")
        .time("now-6h", "now")
        .refresh("30s")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        # Grafana's own built-in annotation (alerts and manual notes); without it the list is empty.
        .annotation(
            AnnotationQuery()
            .name("Annotations & Alerts")
            .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
            .built_in(1)
            .enable(True)
            .hide(True)
            .icon_color("rgba(0, 211, 255, 1)")
            .type("dashboard")
        )
        .link(
            DashboardLink("kvcanary")
            .type(dm.DashboardLinkType.DASHBOARDS)
            .tags(["kvcanary"])
            .as_dropdown(True)
            .include_vars(False)
            .keep_time(True)
        )
        .with_variable(datasource_variable())
    )


def datasource_variable() -> DatasourceVariable:
    """Return the Prometheus data source picker that every panel reads from."""
    return (
        DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .current(dm.VariableOption(selected=True, text="Prometheus", value=DEFAULT_DATASOURCE_UID))
    )


def label_variable(name: str, label: str, query: str, description: str) -> QueryVariable:
    """Return a multi-value variable from ``label_values(...)`` whose "All" is the regex ``.*``.

    ``.*`` (not the list of values Grafana saw) keeps new targets visible without a reload and
    matches an empty label too (incidents that judge a whole target have ``node=""``).
    """
    return (
        QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(DATASOURCE)
        .query(query)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dm.VariableOption(selected=True, text="All", value="$__all"))
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
    )


@dataclass(frozen=True)
class Query:
    """One PromQL target: the expression, its legend, and whether Grafana asks for one instant."""

    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False

    def build(self, ref_id: str) -> prometheus.Dataquery:
        q = prometheus.Dataquery().datasource(DATASOURCE).ref_id(ref_id).expr(self.expr)
        q = q.legend_format(self.legend or "__auto")
        if self.table:
            q = q.format(pm.PromQueryFormat.TABLE)
        return q.instant() if self.instant or self.table else q.range()


def thresholds(*steps: Step) -> ThresholdsConfig:
    """Return absolute thresholds; the first step is the base colour (its value is ``None``)."""
    return (
        ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps([dm.Threshold(value=value, color=color) for color, value in steps])
    )


def fixed_color(color: str) -> dm.DynamicConfigValue:
    return dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": color})


def _with_targets(panel: P, queries: Sequence[Query]) -> P:
    for index, query in enumerate(queries):
        panel = panel.with_target(query.build(chr(ord("A") + index)))
    return panel


def timeseries_panel(
    title: str,
    description: str,
    queries: Sequence[Query],
    unit: str = "short",
    *,
    stack: bool = False,
    bars: bool = False,
    min_val: float | None = 0,
    max_val: float | None = None,
    steps: Sequence[Step] = (),
    colors: dict[str, str] | None = None,
) -> timeseries.Panel:
    """Return a time series panel; ``colors`` maps a regex on series names to a fixed colour.

    With ``steps``, the thresholds are drawn as dashed lines (e.g. headroom 1 and 2).
    """
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .line_width(1)
        .fill_opacity(25 if stack or bars else 10)
        .legend(
            common.VizLegendOptions()
            .show_legend(True)
            .display_mode(cm.LegendDisplayMode.LIST)
            .placement(cm.LegendPlacement.BOTTOM)
            .calcs([])
        )
        .tooltip(common.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
    )
    if min_val is not None:
        panel = panel.min(min_val)
    if max_val is not None:
        panel = panel.max(max_val)
    if stack:
        panel = panel.stacking(common.StackingConfig().mode(cm.StackingMode.NORMAL).group("A"))
    if bars:
        panel = panel.draw_style(cm.GraphDrawStyle.BARS)
    if steps:
        panel = panel.thresholds(thresholds(*steps)).thresholds_style(
            common.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)
        )
    for pattern, color in (colors or {}).items():
        panel = panel.override_by_regexp(pattern, [fixed_color(color)])
    return _with_targets(panel, queries)


def stat_panel(
    title: str,
    description: str,
    queries: Sequence[Query],
    unit: str = "short",
    *,
    steps: Sequence[Step] = ((GREEN, None),),
    decimals: int | None = 0,
    mappings: dict[str, tuple[str, str]] | None = None,
    graph: bool = False,
) -> stat.Panel:
    """Return a stat panel coloured by ``steps``; ``mappings`` maps a value to (text, colour)."""
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .thresholds(thresholds(*steps))
        .color_mode(cm.BigValueColorMode.BACKGROUND)
        .graph_mode(cm.BigValueGraphMode.AREA if graph else cm.BigValueGraphMode.NONE)
        .text_mode(cm.BigValueTextMode.AUTO)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if decimals is not None:
        panel = panel.decimals(decimals)
    if mappings:
        panel = panel.mappings(
            [
                dm.ValueMap(
                    options={
                        value: dm.ValueMappingResult(text=text, color=color, index=index)
                        for index, (value, (text, color)) in enumerate(mappings.items())
                    }
                )
            ]
        )
    return _with_targets(panel, queries)


def table_panel(
    title: str,
    description: str,
    queries: Sequence[Query],
    unit: str = "short",
    *,
    hide: Sequence[str] = ("Time",),
    rename: dict[str, str] | None = None,
    merge: bool = False,
) -> table.Panel:
    """Return a table of instant results: columns in ``hide`` dropped, ``rename`` applied."""
    panel = table.Panel().title(title).description(description).datasource(DATASOURCE).unit(unit)
    if merge:
        panel = panel.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
    panel = panel.with_transformation(
        dm.DataTransformerConfig(
            id_val="organize",
            options={"excludeByName": dict.fromkeys(hide, True), "renameByName": rename or {}},
        )
    )
    return _with_targets(panel, queries)


class Grid:
    """Lay panels out left to right on Grafana's 24-column grid and number every panel once.

    ``row()`` starts a titled row on a new line; ``add()`` places a panel of ``w`` columns and
    ``h`` rows after the previous one, wrapping to a new line when it would not fit.
    """

    def __init__(self, dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        self._next_id = 1
        self._x = 0
        self._y = 0
        self._line_height = 0

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _newline(self) -> None:
        self._y += self._line_height
        self._x = 0
        self._line_height = 0

    def row(self, title: str) -> Grid:
        self._newline()
        grid_pos = dm.GridPos(h=1, w=GRID_COLUMNS, x=0, y=self._y)
        self.dashboard = self.dashboard.with_row(Row(title).id(self._id()).grid_pos(grid_pos))
        self._y += 1
        return self

    def add(self, panel: Builder[dm.Panel], w: int, h: int) -> Grid:
        if not 0 < w <= GRID_COLUMNS:
            raise ValueError(f"panel width {w} is outside 1..{GRID_COLUMNS}")
        if self._x + w > GRID_COLUMNS:
            self._newline()
        grid_pos = dm.GridPos(h=h, w=w, x=self._x, y=self._y)
        # Panel builders share these two methods; the SDK types them per panel kind.
        self.dashboard = self.dashboard.with_panel(panel.id(self._id()).grid_pos(grid_pos))  # type: ignore[attr-defined]
        self._x += w
        self._line_height = max(self._line_height, h)
        return self
