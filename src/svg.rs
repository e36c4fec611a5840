//! A small, dependency-free SVG line-chart writer for `kvswap demo --sweep`.
//!
//! A [`Chart`] is a title, a shared x axis and one or more vertically stacked
//! [`Panel`]s, each with its own y axis and one or more [`Series`]. Axes get
//! "nice" ticks (1, 2, 5 x 10^n), the x axis can be log2 (slot counts are
//! powers of two), and every text is XML-escaped.

use std::fmt::Write as _;

/// Width of the whole picture, in SVG user units (pixels).
const WIDTH: f64 = 760.0;
/// Height of one panel's plotting area.
const PLOT_H: f64 = 190.0;
/// Space above the first panel for the chart title.
const TITLE_H: f64 = 62.0;
/// Space between the bottom of one plotting area and the top of the next
/// (x tick labels, x axis label, next panel title).
const GAP_H: f64 = 86.0;
const LEFT: f64 = 92.0;
const RIGHT: f64 = 28.0;
const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];

/// One line: `(x, y)` points, drawn in x order.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One plotting area with its own y axis.
#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    pub title: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Start the y axis at 0 when all values are positive.
    pub y_from_zero: bool,
}

/// Stacked panels sharing one x axis.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    pub title: String,
    /// A smaller second line under the title (settings, units); may be empty.
    pub subtitle: String,
    pub x_label: String,
    /// Log2 x axis (ticks at powers of two).
    pub x_log2: bool,
    pub panels: Vec<Panel>,
}

/// Escapes `&`, `<`, `>`, `"` and `'` for SVG text and attributes.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            _ => out.push(c),
        }
    }
    out
}

/// Ticks covering `[lo, hi]` with a step of 1, 2 or 5 x 10^n, about `target` of them.
pub fn nice_ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let (lo, hi) = if hi > lo { (lo, hi) } else { (lo - 1.0, lo + 1.0) };
    let raw = (hi - lo) / target.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    let first = (lo / step).floor() as i64;
    let last = (hi / step).ceil() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// A tick label on an axis whose largest absolute tick is `max_abs`: one
/// SI suffix for the whole axis (k from 10,000, M from 1e6, G from 1e9),
/// decimals from the tick step.
pub fn tick_label(v: f64, step: f64, max_abs: f64) -> String {
    let (scale, suffix) = match max_abs.abs() {
        a if a >= 1e9 => (1e9, "G"),
        a if a >= 1e6 => (1e6, "M"),
        a if a >= 1e4 => (1e3, "k"),
        _ => (1.0, ""),
    };
    let s = step / scale;
    let decimals = if s >= 1.0 || s <= 0.0 { 0 } else { (-s.log10().floor()) as usize };
    if v.abs() < step.abs() * 1e-9 {
        return "0".to_string();
    }
    format!("{:.*}{}", decimals, v / scale, suffix)
}

/// Maps data values to pixels along one axis.
struct Axis {
    lo: f64,
    hi: f64,
    log2: bool,
    from: f64,
    to: f64,
}

impl Axis {
    fn t(&self, v: f64) -> f64 {
        if self.log2 {
            v.max(f64::MIN_POSITIVE).log2()
        } else {
            v
        }
    }
    fn px(&self, v: f64) -> f64 {
        let (a, b) = (self.t(self.lo), self.t(self.hi));
        self.from + (self.t(v) - a) / (b - a) * (self.to - self.from)
    }
}

impl Chart {
    fn height(&self) -> f64 {
        TITLE_H + self.panels.len().max(1) as f64 * (PLOT_H + GAP_H)
    }

    fn all_x(&self) -> Vec<f64> {
        let mut xs: Vec<f64> = self
            .panels
            .iter()
            .flat_map(|p| p.series.iter().flat_map(|s| s.points.iter().map(|p| p.0)))
            .filter(|x| x.is_finite() && (!self.x_log2 || *x > 0.0))
            .collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        xs
    }

    /// The x range and tick positions.
    fn x_ticks(&self) -> (f64, f64, Vec<f64>) {
        let xs = self.all_x();
        let (lo, hi) = match (xs.first(), xs.last()) {
            (Some(&a), Some(&b)) if b > a => (a, b),
            (Some(&a), _) if self.x_log2 => (a / 2.0, a * 2.0),
            (Some(&a), _) => (a - 1.0, a + 1.0),
            _ => (if self.x_log2 { 1.0 } else { 0.0 }, 2.0),
        };
        let ticks = if self.x_log2 {
            let (a, b) = (lo.log2().ceil() as i32, hi.log2().floor() as i32);
            (a..=b).map(|e| 2f64.powi(e)).collect()
        } else if !xs.is_empty() && xs.len() <= 10 {
            xs
        } else {
            nice_ticks(lo, hi, 6).into_iter().filter(|t| *t >= lo && *t <= hi).collect()
        };
        (lo, hi, ticks)
    }

    /// The SVG document.
    pub fn to_svg(&self) -> String {
        let (w, h) = (WIDTH, self.height());
        let mut out = String::new();
        let _ = writeln!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            out,
            r#"<text x="{}" y="26" text-anchor="middle" font-size="16" font-weight="bold">{}</text>"#,
            w / 2.0,
            escape(&self.title)
        );
        if !self.subtitle.is_empty() {
            let _ = writeln!(
                out,
                r##"<text x="{}" y="44" text-anchor="middle" font-size="11" fill="#444">{}</text>"##,
                w / 2.0,
                escape(&self.subtitle)
            );
        }
        let (lo, hi, ticks) = self.x_ticks();
        for (i, panel) in self.panels.iter().enumerate() {
            let top = TITLE_H + i as f64 * (PLOT_H + GAP_H) + 14.0;
            let x = Axis { lo, hi, log2: self.x_log2, from: LEFT, to: w - RIGHT };
            out += &self.panel_svg(panel, top, &x, &ticks);
        }
        out += "</svg>\n";
        out
    }

    fn panel_svg(&self, panel: &Panel, top: f64, x: &Axis, x_ticks: &[f64]) -> String {
        let bottom = top + PLOT_H;
        let (y_lo, y_hi, y_ticks) = y_range(panel);
        let y = Axis { lo: y_lo, hi: y_hi, log2: false, from: bottom, to: top };
        let mut s = String::new();
        let _ = writeln!(s, r#"<g class="panel">"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-size="13" font-weight="bold">{}</text>"#,
            (x.from + x.to) / 2.0,
            top - 6.0,
            escape(&panel.title)
        );
        s += &grid_and_ticks(x, &y, x_ticks, &y_ticks);
        let _ = writeln!(
            s,
            r##"<rect x="{}" y="{top}" width="{}" height="{PLOT_H}" fill="none" stroke="#333"/>"##,
            x.from,
            x.to - x.from
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            (x.from + x.to) / 2.0,
            bottom + 36.0,
            escape(&self.x_label)
        );
        let mid = (top + bottom) / 2.0;
        let _ = writeln!(
            s,
            r#"<text x="18" y="{mid}" text-anchor="middle" transform="rotate(-90 18 {mid})">{}</text>"#,
            escape(&panel.y_label)
        );
        for (k, series) in panel.series.iter().enumerate() {
            s += &series_svg(series, COLORS[k % COLORS.len()], x, &y);
        }
        if panel.series.len() > 1 {
            s += &legend(panel, x.to - 170.0, top + 8.0);
        }
        s += "</g>\n";
        s
    }
}

/// The y range and ticks of a panel (padded when the data are flat).
fn y_range(panel: &Panel) -> (f64, f64, Vec<f64>) {
    let ys: Vec<f64> =
        panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).filter(|v| v.is_finite()).collect();
    let mut lo = ys.iter().copied().fold(f64::INFINITY, f64::min);
    let mut hi = ys.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if ys.is_empty() {
        (lo, hi) = (0.0, 1.0);
    }
    if panel.y_from_zero && lo > 0.0 {
        lo = 0.0;
    }
    if hi <= lo {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        (lo, hi) = (lo - if panel.y_from_zero && lo == 0.0 { 0.0 } else { pad }, hi + pad);
    }
    let ticks = nice_ticks(lo, hi, 5);
    let (first, last) = (ticks[0], ticks[ticks.len() - 1]);
    (first, last, ticks)
}

fn grid_and_ticks(x: &Axis, y: &Axis, x_ticks: &[f64], y_ticks: &[f64]) -> String {
    let mut s = String::new();
    let (top, bottom) = (y.to, y.from);
    for &t in x_ticks {
        let px = x.px(t);
        let _ = writeln!(
            s,
            r##"<line x1="{px:.1}" y1="{top}" x2="{px:.1}" y2="{bottom}" stroke="#ddd"/><line x1="{px:.1}" y1="{bottom}" x2="{px:.1}" y2="{}" stroke="#333"/><text x="{px:.1}" y="{}" text-anchor="middle">{}</text>"##,
            bottom + 5.0,
            bottom + 18.0,
            escape(&tick_label(t, if t >= 1.0 { 1.0 } else { t }, 0.0))
        );
    }
    let step = if y_ticks.len() > 1 { y_ticks[1] - y_ticks[0] } else { 1.0 };
    let max_abs = y_ticks.iter().fold(0.0f64, |m, t| m.max(t.abs()));
    for &t in y_ticks {
        let py = y.px(t);
        let _ = writeln!(
            s,
            r##"<line x1="{}" y1="{py:.1}" x2="{}" y2="{py:.1}" stroke="#ddd"/><line x1="{}" y1="{py:.1}" x2="{}" y2="{py:.1}" stroke="#333"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            x.from,
            x.to,
            x.from - 5.0,
            x.from,
            x.from - 8.0,
            py + 4.0,
            escape(&tick_label(t, step, max_abs))
        );
    }
    s
}

fn series_svg(series: &Series, color: &str, x: &Axis, y: &Axis) -> String {
    let mut pts: Vec<(f64, f64)> = series
        .points
        .iter()
        .copied()
        .filter(|(a, b)| a.is_finite() && b.is_finite() && (!x.log2 || *a > 0.0))
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let coords: Vec<String> = pts.iter().map(|&(a, b)| format!("{:.1},{:.1}", x.px(a), y.px(b))).collect();
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"><title>{}</title></polyline>"#,
        coords.join(" "),
        escape(&series.label)
    );
    for &(a, b) in &pts {
        let _ = writeln!(
            s,
            r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{color}"><title>{}: x={} y={}</title></circle>"#,
            x.px(a),
            y.px(b),
            escape(&series.label),
            a,
            b
        );
    }
    s
}

fn legend(panel: &Panel, left: f64, top: f64) -> String {
    let mut s = String::new();
    for (k, series) in panel.series.iter().enumerate() {
        let yk = top + 8.0 + k as f64 * 16.0;
        let color = COLORS[k % COLORS.len()];
        let _ = writeln!(
            s,
            r#"<line x1="{left}" y1="{yk}" x2="{}" y2="{yk}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
            left + 18.0,
            left + 24.0,
            yk + 4.0,
            escape(&series.label)
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(points: Vec<(f64, f64)>) -> Chart {
        Chart {
            title: "hit rate <vs> slots & \"more\"".into(),
            subtitle: "a < b".into(),
            x_label: "gpu_chunks".into(),
            x_log2: true,
            panels: vec![Panel {
                title: "hit rate".into(),
                y_label: "hit rate".into(),
                series: vec![Series { label: "a".into(), points }],
                y_from_zero: true,
            }],
        }
    }

    #[test]
    fn writes_a_complete_escaped_document() {
        let svg = chart(vec![(512.0, 0.5), (1024.0, 0.7), (2048.0, 0.9)]).to_svg();
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("&lt;vs&gt; slots &amp; &quot;more&quot;"));
        assert!(svg.contains(">a &lt; b<"));
        assert!(!svg.contains("<vs>"));
        assert_eq!(svg.matches("<circle").count(), 3);
        assert!(svg.contains(">512<") && svg.contains(">1024<") && svg.contains(">2048<"), "x ticks");
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn degenerate_data_still_draws() {
        for pts in [vec![], vec![(512.0, 3.0)], vec![(512.0, 0.0), (1024.0, 0.0)], vec![(1.0, f64::NAN)]] {
            let svg = chart(pts).to_svg();
            assert!(svg.starts_with("<svg") && svg.contains("</svg>"));
            assert!(!svg.contains("NaN"), "{svg}");
        }
    }

    #[test]
    fn ticks_are_nice() {
        assert_eq!(nice_ticks(0.0, 1.0, 5), vec![0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]);
        assert_eq!(nice_ticks(0.0, 95.0, 5), vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        assert_eq!(tick_label(0.4, 0.2, 1.0), "0.4");
        assert_eq!(tick_label(40.0, 20.0, 100.0), "40");
        assert_eq!(tick_label(600_000.0, 200_000.0, 800_000.0), "600k");
        assert_eq!(tick_label(2.5e6, 5e5, 3e6), "2.5M");
        assert_eq!(tick_label(5e5, 5e5, 3e6), "0.5M", "one suffix per axis");
        assert_eq!(tick_label(8192.0, 1.0, 0.0), "8192");
        assert_eq!(tick_label(0.0, 2e5, 1e6), "0");
    }
}
