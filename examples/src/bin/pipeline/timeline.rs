//! The timeline picture: one row per stage, a block per forward and backward pass of each
//! micro-batch over the step's time, from the timestamps the stages recorded.

use std::path::Path;

use anyhow::Result;
use autograd_dist::{Action, StepReport};
use embedded_graphics::mono_font::ascii::FONT_6X10;
use embedded_graphics::mono_font::MonoTextStyle;
use embedded_graphics::pixelcolor::Rgb888;
use embedded_graphics::prelude::*;
use embedded_graphics::primitives::{PrimitiveStyle, PrimitiveStyleBuilder, Rectangle};
use embedded_graphics::text::Text;
use examples::canvas::Canvas;

/// Draws `report`'s passes to `path` (PNG) under `title`.
pub fn draw(report: &StepReport, workers: &[String], title: &str, path: &Path) -> Result<()> {
    let stages = workers.len().max(1);
    let (left, top, row, w) = (110i32, 40i32, 46i32, 1100u32);
    let h = (top + row * stages as i32 + 50) as u32;
    let mut c = Canvas::new(w, h);
    let black = MonoTextStyle::new(&FONT_6X10, Rgb888::BLACK);
    let white = MonoTextStyle::new(&FONT_6X10, Rgb888::WHITE);
    Text::new(title, Point::new(10, 16), black).draw(&mut c)?;
    let (t0, t1) = report.span_us;
    let span = t1.saturating_sub(t0).max(1) as f64;
    let plot_w = f64::from(w) - f64::from(left) - 20.0;
    let x_of = |us: u64| left + (us.saturating_sub(t0) as f64 / span * plot_w).round() as i32;
    for (s, worker) in workers.iter().enumerate() {
        let y = top + row * s as i32;
        Text::new(&format!("stage {s}"), Point::new(10, y + 16), black).draw(&mut c)?;
        Text::new(worker, Point::new(10, y + 30), black).draw(&mut c)?;
        Rectangle::new(
            Point::new(left, y + 4),
            Size::new(plot_w as u32, (row - 8) as u32),
        )
        .into_styled(PrimitiveStyle::with_fill(Rgb888::new(240, 240, 240)))
        .draw(&mut c)?;
    }
    for e in &report.events {
        let y = top + row * e.stage as i32;
        let (x0, x1) = (x_of(e.start_us), x_of(e.end_us).max(x_of(e.start_us) + 1));
        let (fill, j) = match e.action {
            Action::Forward(j) => (Rgb888::new(66, 133, 244), j),
            Action::Backward(j) => (Rgb888::new(52, 168, 83), j),
        };
        let style = PrimitiveStyleBuilder::new()
            .fill_color(fill)
            .stroke_color(Rgb888::WHITE)
            .stroke_width(1)
            .build();
        Rectangle::new(
            Point::new(x0, y + 4),
            Size::new((x1 - x0) as u32, (row - 8) as u32),
        )
        .into_styled(style)
        .draw(&mut c)?;
        if x1 - x0 >= 14 {
            Text::new(&j.to_string(), Point::new(x0 + 3, y + row / 2 + 3), white).draw(&mut c)?;
        }
    }
    let y = top + row * stages as i32 + 16;
    Text::new(
        &format!("0 ms  ...  {:.1} ms", span / 1e3),
        Point::new(left, y),
        black,
    )
    .draw(&mut c)?;
    for (i, (label, fill)) in [
        ("forward (micro-batch)", Rgb888::new(66, 133, 244)),
        ("backward", Rgb888::new(52, 168, 83)),
        ("idle (bubble)", Rgb888::new(240, 240, 240)),
    ]
    .into_iter()
    .enumerate()
    {
        let x = left + 220 + 190 * i as i32;
        Rectangle::new(Point::new(x, y - 9), Size::new(12, 12))
            .into_styled(PrimitiveStyle::with_fill(fill))
            .draw(&mut c)?;
        Text::new(label, Point::new(x + 16, y), black).draw(&mut c)?;
    }
    c.save_png(path)
}
