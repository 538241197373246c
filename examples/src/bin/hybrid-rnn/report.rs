//! What the user sees: the training history, the confusion matrix, the PNG plot and the final
//! JSON line.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use embedded_graphics::mono_font::ascii::FONT_6X10;
use embedded_graphics::mono_font::MonoTextStyle;
use embedded_graphics::pixelcolor::Rgb888;
use embedded_graphics::prelude::*;
use embedded_graphics::primitives::{Line, Polyline, PrimitiveStyle, Rectangle};
use embedded_graphics::text::Text;
use examples::canvas::Canvas;
use examples::lang::model::Dims;
use examples::lang::wordlang::LANGS;
use examples::recovery::Recovery;
use examples::round;
use rpc_core::Agent;
use serde_json::json;

use crate::args::Args;
use crate::hybrid::Hybrid;
use crate::shard;

/// Steps excluded from step-time medians.
const WARMUP: usize = 10;

/// What a finished run reports.
pub struct Summary<'a> {
    pub args: &'a Args,
    pub dims: &'a Dims,
    /// The test set's labels and the model's predictions.
    pub labels: &'a [u32],
    pub preds: &'a [u32],
    pub history: &'a History,
    pub steps: u64,
    /// Milliseconds per step: distributed, one process.
    pub step_times: Vec<f64>,
    pub local_times: Vec<f64>,
    pub max_loss_diff: Option<f64>,
    pub recoveries: Vec<Recovery>,
    pub checkpoint: Option<PathBuf>,
    pub start: Instant,
}

impl Summary<'_> {
    /// Prints the confusion matrix, draws the plot, and prints the JSON line (the last line of
    /// the output).
    pub async fn print(self, agent: &Agent, model: &Hybrid) -> Result<()> {
        let test_acc = accuracy(self.preds, self.labels);
        println!(
            "\nconfusion matrix (test set):\n{}",
            confusion_matrix(self.labels, self.preds, &LANGS)
        );
        let plot_path = self.args.out_dir.join("training.png");
        plot(self.history, &plot_path)?;
        println!("plot: {}", plot_path.display());

        let replica_diff = model.replica_diff().await?;
        let params_sha256 = model.params_sha256(self.dims).await?;
        let rss = futures::try_join!(
            agent.rpc_async(shard::SHARD_RANKS[0], shard::peak_rss_mb, ()),
            agent.rpc_async(shard::SHARD_RANKS[1], shard::peak_rss_mb, ())
        )?;
        let dist = median_ms(self.step_times);
        let local = median_ms(self.local_times);
        let mut line = json!({
            "test_accuracy": round(test_acc, 4),
            "epochs": self.args.epochs,
            "steps": self.steps,
            "ms_per_step_median": dist.map(|x| round(x, 2)),
            "local_ms_per_step_median": local.map(|x| round(x, 2)),
            "distributed_over_local": dist.zip(local).map(|(d, l)| round(d / l, 3)),
            "max_loss_diff": self.max_loss_diff,
            "replica_max_diff": replica_diff,
            "params_sha256": params_sha256,
            "languages": LANGS.len(),
            "encoder": if self.dims.bidirectional { "bilstm" } else { "lstm" },
            "master_peak_rss_mb": round(examples::peak_rss_mb(), 1),
            "worker_peak_rss_mb": [round(rss.0, 1), round(rss.1, 1)],
            "wall_s": round(self.start.elapsed().as_secs_f64(), 1),
            "checkpoint": self.checkpoint.map(|p| p.display().to_string()),
            "plot": plot_path.display().to_string(),
        });
        line.as_object_mut()
            .expect("an object")
            .extend(examples::recovery::report(&self.recoveries));
        println!("{line}");
        Ok(())
    }
}

/// The median of `v` after the warm-up steps.
fn median_ms(mut v: Vec<f64>) -> Option<f64> {
    let skip = if v.len() > WARMUP { WARMUP } else { 0 };
    v.drain(..skip);
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// The share of `preds` equal to `labels`.
pub fn accuracy(preds: &[u32], labels: &[u32]) -> f64 {
    preds.iter().zip(labels).filter(|(p, y)| p == y).count() as f64 / labels.len().max(1) as f64
}

/// Loss and accuracy curves.
#[derive(Clone, Debug, Default)]
pub struct History {
    /// (global step, mean training loss over the last window).
    pub loss: Vec<(f64, f64)>,
    /// Per epoch: training accuracy (with dropout) and test accuracy.
    pub train_acc: Vec<f64>,
    /// Per epoch.
    pub test_acc: Vec<f64>,
}

impl History {
    /// Adds the curves to a checkpoint's tensors.
    pub fn save(&self, m: &mut HashMap<String, Tensor>) -> Result<()> {
        let dev = &Device::Cpu;
        let (steps, losses): (Vec<f64>, Vec<f64>) = self.loss.iter().copied().unzip();
        m.insert(
            "history.loss_step".into(),
            Tensor::new(steps.as_slice(), dev)?,
        );
        m.insert("history.loss".into(), Tensor::new(losses.as_slice(), dev)?);
        m.insert(
            "history.train_accuracy".into(),
            Tensor::new(self.train_acc.as_slice(), dev)?,
        );
        m.insert(
            "history.test_accuracy".into(),
            Tensor::new(self.test_acc.as_slice(), dev)?,
        );
        Ok(())
    }

    /// Reads the curves back from a checkpoint's tensors.
    pub fn load(m: &HashMap<String, Tensor>) -> Result<Self> {
        let get = |n: &str| -> Result<Vec<f64>> {
            Ok(m.get(n)
                .with_context(|| format!("checkpoint has no `{n}`"))?
                .to_dtype(candle_core::DType::F64)?
                .to_vec1()?)
        };
        let steps = get("history.loss_step")?;
        let losses = get("history.loss")?;
        Ok(Self {
            loss: steps.into_iter().zip(losses).collect(),
            train_acc: get("history.train_accuracy")?,
            test_acc: get("history.test_accuracy")?,
        })
    }
}

/// A confusion matrix as text: rows are true languages, columns predictions.
pub fn confusion_matrix(labels: &[u32], preds: &[u32], names: &[&str]) -> String {
    let n = names.len();
    let mut m = vec![vec![0usize; n]; n];
    for (&y, &p) in labels.iter().zip(preds) {
        if (y as usize) < n && (p as usize) < n {
            m[y as usize][p as usize] += 1;
        }
    }
    let short: Vec<String> = names.iter().map(|s| s.chars().take(7).collect()).collect();
    let mut out = format!("{:>18}", "true \\ predicted");
    for s in &short {
        out += &format!(" {s:>7}");
    }
    out += "   recall\n";
    for (i, row) in m.iter().enumerate() {
        out += &format!("{:>18}", names[i]);
        for c in row {
            out += &format!(" {c:>7}");
        }
        let total: usize = row.iter().sum();
        out += &format!("   {:.3}\n", row[i] as f64 / total.max(1) as f64);
    }
    out
}

/// One chart panel: axes with labelled ranges and a title, then series mapped into it.
struct Panel {
    x0: i32,
    y0: i32,
    w: i32,
    h: i32,
    xr: (f64, f64),
    yr: (f64, f64),
}

impl Panel {
    fn point(&self, x: f64, y: f64) -> Point {
        let fx = (x - self.xr.0) / (self.xr.1 - self.xr.0).max(1e-12);
        let fy = (y - self.yr.0) / (self.yr.1 - self.yr.0).max(1e-12);
        Point::new(
            self.x0 + (fx * self.w as f64).round() as i32,
            self.y0 + self.h - (fy * self.h as f64).round() as i32,
        )
    }

    fn axes(&self, c: &mut Canvas, title: &str, xlabel: &str) {
        let black = Rgb888::BLACK;
        let grey = Rgb888::new(220, 220, 220);
        let text = MonoTextStyle::new(&FONT_6X10, black);
        for k in 0..=4 {
            let y = self.yr.0 + (self.yr.1 - self.yr.0) * k as f64 / 4.0;
            let p = self.point(self.xr.0, y);
            let _ = Line::new(p, Point::new(self.x0 + self.w, p.y))
                .into_styled(PrimitiveStyle::with_stroke(grey, 1))
                .draw(c);
            let _ = Text::new(&format!("{y:.2}"), Point::new(self.x0 - 34, p.y + 3), text).draw(c);
        }
        let _ = Rectangle::new(
            Point::new(self.x0, self.y0),
            Size::new(self.w as u32, self.h as u32),
        )
        .into_styled(PrimitiveStyle::with_stroke(black, 1))
        .draw(c);
        let _ = Text::new(title, Point::new(self.x0, self.y0 - 8), text).draw(c);
        let (lo, hi) = (format!("{:.0}", self.xr.0), format!("{:.0}", self.xr.1));
        let base = self.y0 + self.h + 14;
        let _ = Text::new(&lo, Point::new(self.x0, base), text).draw(c);
        let _ = Text::new(
            &hi,
            Point::new(self.x0 + self.w - 6 * hi.len() as i32, base),
            text,
        )
        .draw(c);
        let _ = Text::new(
            xlabel,
            Point::new(self.x0 + self.w / 2 - 3 * xlabel.len() as i32, base),
            text,
        )
        .draw(c);
    }

    fn series(&self, c: &mut Canvas, pts: &[(f64, f64)], color: Rgb888, label: &str, slot: i32) {
        let mapped: Vec<Point> = pts.iter().map(|&(x, y)| self.point(x, y)).collect();
        let style = PrimitiveStyle::with_stroke(color, 2);
        if mapped.len() == 1 {
            let _ = Rectangle::with_center(mapped[0], Size::new(5, 5))
                .into_styled(PrimitiveStyle::with_fill(color))
                .draw(c);
        } else {
            let _ = Polyline::new(&mapped).into_styled(style).draw(c);
        }
        for p in &mapped {
            let _ = Rectangle::with_center(*p, Size::new(3, 3))
                .into_styled(PrimitiveStyle::with_fill(color))
                .draw(c);
        }
        let ly = self.y0 + 12 + 12 * slot;
        let lx = self.x0 + self.w - 130;
        let _ = Line::new(Point::new(lx, ly - 3), Point::new(lx + 16, ly - 3))
            .into_styled(style)
            .draw(c);
        let _ = Text::new(
            label,
            Point::new(lx + 22, ly),
            MonoTextStyle::new(&FONT_6X10, Rgb888::BLACK),
        )
        .draw(c);
    }
}

/// Draws the training loss (per step window) and the accuracies (per epoch) into a PNG.
pub fn plot(history: &History, path: &Path) -> Result<()> {
    let (w, h) = (960u32, 420u32);
    let mut c = Canvas::new(w, h);
    let maxl = history
        .loss
        .iter()
        .map(|p| p.1)
        .fold(0.0, f64::max)
        .max(1e-3);
    let maxs = history.loss.last().map_or(1.0, |p| p.0).max(1.0);
    let left = Panel {
        x0: 60,
        y0: 40,
        w: 380,
        h: 320,
        xr: (0.0, maxs),
        yr: (0.0, maxl * 1.05),
    };
    left.axes(&mut c, "training loss", "step");
    left.series(
        &mut c,
        &history.loss,
        Rgb888::new(31, 119, 180),
        "train loss",
        0,
    );
    let epochs = history.test_acc.len().max(1) as f64;
    let lo = history
        .test_acc
        .iter()
        .chain(&history.train_acc)
        .fold(1.0f64, |a, &b| a.min(b));
    let lo = ((lo * 10.0).floor() / 10.0).clamp(0.0, 0.9);
    let right = Panel {
        x0: 540,
        y0: 40,
        w: 380,
        h: 320,
        xr: (0.0, epochs),
        yr: (lo, 1.0),
    };
    right.axes(&mut c, "accuracy", "epoch");
    let per_epoch = |v: &[f64]| {
        v.iter()
            .enumerate()
            .map(|(i, &a)| ((i + 1) as f64, a))
            .collect::<Vec<_>>()
    };
    right.series(
        &mut c,
        &per_epoch(&history.train_acc),
        Rgb888::new(255, 127, 14),
        "train (dropout)",
        0,
    );
    right.series(
        &mut c,
        &per_epoch(&history.test_acc),
        Rgb888::new(44, 160, 44),
        "test",
        1,
    );

    c.save_png(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confusion_matrix_counts_and_recalls() {
        let s = confusion_matrix(&[0, 0, 1, 1], &[0, 1, 1, 1], &["aa", "bb"]);
        let rows: Vec<&str> = s.lines().collect();
        assert!(
            rows[1].trim_start().starts_with("aa") && rows[1].contains("0.500"),
            "{s}"
        );
        assert!(rows[2].contains("1.000"), "{s}");
    }

    #[test]
    fn plot_writes_a_png() {
        let dir = std::env::temp_dir().join(format!("hybrid-rnn-plot-{}", std::process::id()));
        let path = dir.join("p.png");
        let h = History {
            loss: vec![(10.0, 2.0), (20.0, 1.0), (30.0, 0.5)],
            train_acc: vec![0.7, 0.8],
            test_acc: vec![0.75, 0.82],
        };
        plot(&h, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
