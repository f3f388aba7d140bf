//! Small self-contained SVG line charts (no fonts or plotting library needed).

use std::fmt::Write as _;

/// How an axis maps values to positions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scale {
    /// Linear from 0 (or the smallest value, if negative) to the largest value.
    Linear,
    /// Logarithmic (values must be > 0).
    Log,
    /// Percentiles on a "nines" scale: 50 → 0.3, 90 → 1, 99 → 2, 99.9 → 3 (tails visible).
    Nines,
}

impl Scale {
    fn map(self, v: f64) -> f64 {
        match self {
            Scale::Linear => v,
            Scale::Log => v.max(f64::MIN_POSITIVE).log10(),
            Scale::Nines => -(1.0 - (v / 100.0).min(0.999_999)).log10(),
        }
    }
}

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// (x, y) points in data units, drawn in order.
    pub points: Vec<(f64, f64)>,
}

/// A line chart.
#[derive(Debug, Clone)]
pub struct Chart {
    /// Title above the plot.
    pub title: String,
    /// Label under the x axis.
    pub x_label: String,
    /// Label beside the y axis.
    pub y_label: String,
    /// Mapping of the x axis.
    pub x_scale: Scale,
    /// Mapping of the y axis.
    pub y_scale: Scale,
    /// The lines.
    pub series: Vec<Series>,
}

const W: f64 = 760.0;
const H: f64 = 440.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 180.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 8] = [
    "#000000", "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A compact number: 1.2k, 35, 0.5, 2.1M.
pub fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.3}M", v / 1e6)
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
            .replace(".M", "M")
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 1e3 {
        format!("{:.1}k", v / 1e3).replace(".0k", "k")
    } else if a >= 10.0 || a == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}

/// Tick positions (in data units) for an axis spanning `lo..=hi` (data units).
fn ticks(scale: Scale, lo: f64, hi: f64) -> Vec<f64> {
    match scale {
        Scale::Nines => [0.0, 50.0, 90.0, 99.0, 99.9, 99.99, 99.999]
            .into_iter()
            .filter(|p| *p >= lo - 1e-9 && *p <= hi + 1e-9)
            .collect(),
        Scale::Log => {
            let mut out = vec![];
            let mut d = 10f64.powf(lo.log10().floor());
            while d <= hi * 1.000_001 {
                for m in [1.0, 2.0, 5.0] {
                    let t = d * m;
                    if t >= lo * 0.999_999 && t <= hi * 1.000_001 {
                        out.push(t);
                    }
                }
                d *= 10.0;
            }
            out
        }
        Scale::Linear => {
            let span = (hi - lo).max(f64::MIN_POSITIVE);
            let raw = span / 5.0;
            let mag = 10f64.powf(raw.log10().floor());
            let step = [1.0, 2.0, 5.0, 10.0]
                .into_iter()
                .map(|m| m * mag)
                .find(|s| span / s <= 6.0)
                .unwrap_or(raw);
            let mut out = vec![];
            let mut t = (lo / step).ceil() * step;
            while t <= hi + step * 1e-9 {
                out.push(t);
                t += step;
            }
            out
        }
    }
}

fn range(scale: Scale, values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite() && (scale != Scale::Log || *v > 0.0)) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (1.0, 10.0);
    }
    match scale {
        Scale::Linear => (lo.min(0.0), if hi > lo.min(0.0) { hi * 1.05 } else { 1.0 }),
        Scale::Log => {
            let lo = 10f64.powf(lo.log10().floor());
            let hi = 10f64.powf(hi.log10().ceil().max(lo.log10() + 1.0));
            (lo, hi)
        }
        Scale::Nines => (lo.min(50.0), hi.max(99.0)),
    }
}

impl Chart {
    /// The chart as an SVG document.
    pub fn render(&self) -> String {
        let xs = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0));
        let ys = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1));
        let (x0, x1) = range(self.x_scale, xs);
        let (y0, y1) = range(self.y_scale, ys);
        let (mx0, mx1) = (self.x_scale.map(x0), self.x_scale.map(x1));
        let (my0, my1) = (self.y_scale.map(y0), self.y_scale.map(y1));
        let pw = W - LEFT - RIGHT;
        let ph = H - TOP - BOTTOM;
        let px = |x: f64| LEFT + (self.x_scale.map(x) - mx0) / (mx1 - mx0).max(1e-12) * pw;
        let py = |y: f64| TOP + ph - (self.y_scale.map(y) - my0) / (my1 - my0).max(1e-12) * ph;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
            LEFT + pw / 2.0,
            escape(&self.title)
        );
        for t in ticks(self.x_scale, x0, x1) {
            let x = px(t);
            let label = if self.x_scale == Scale::Nines {
                format!("{t}%")
            } else {
                short(t)
            };
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#ddd"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{label}</text>"##,
                TOP + ph,
                TOP + ph + 16.0
            );
        }
        for t in ticks(self.y_scale, y0, y1) {
            let y = py(t);
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + pw,
                LEFT - 6.0,
                y + 4.0,
                short(t)
            );
        }
        let _ = writeln!(
            s,
            r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            H - 18.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text transform="translate(18,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + ph / 2.0,
            escape(&self.y_label)
        );
        for (i, series) in self.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let pts: Vec<String> = series
                .points
                .iter()
                .filter(|(x, y)| {
                    x.is_finite()
                        && y.is_finite()
                        && (self.x_scale != Scale::Log || *x > 0.0)
                        && (self.y_scale != Scale::Log || *y > 0.0)
                })
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
                pts.join(" ")
            );
            for p in &pts {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{color}"/>"#);
            }
            let ly = TOP + 10.0 + i as f64 * 20.0;
            let lx = LEFT + pw + 14.0;
            let _ = writeln!(
                s,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
                lx + 22.0,
                lx + 28.0,
                ly + 4.0,
                escape(&series.name)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_series_and_escapes_text() {
        let chart = Chart {
            title: "a <b> & c".into(),
            x_label: "percentile".into(),
            y_label: "µs".into(),
            x_scale: Scale::Nines,
            y_scale: Scale::Log,
            series: vec![
                Series {
                    name: "direct".into(),
                    points: vec![(50.0, 100.0), (99.0, 300.0), (99.9, 900.0)],
                },
                Series {
                    name: "haproxy".into(),
                    points: vec![(50.0, 150.0), (99.0, 0.0)],
                },
            ],
        };
        let svg = chart.render();
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("a &lt;b&gt; &amp; c"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        // The zero latency cannot be drawn on a log axis and is left out, not drawn at -inf.
        assert_eq!(svg.matches("<circle").count(), 4);
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        assert!(svg.contains(">99.9%<"));
    }

    #[test]
    fn ticks_cover_the_range() {
        assert_eq!(ticks(Scale::Log, 1.0, 10000.0).first(), Some(&1.0));
        assert_eq!(ticks(Scale::Log, 1.0, 10000.0).last(), Some(&10000.0));
        let lin = ticks(Scale::Linear, 0.0, 1.05);
        assert!(lin.len() >= 3 && lin[0] == 0.0, "{lin:?}");
        assert_eq!(short(20_800.0), "21k");
        assert_eq!(short(1_500.0), "1.5k");
        assert_eq!(short(0.96), "0.96");
    }
}
