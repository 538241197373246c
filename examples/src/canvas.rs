//! An RGB image to draw on with `embedded-graphics`, saved as PNG (the examples' plots).

use std::path::Path;

use anyhow::{Context, Result};
use embedded_graphics::pixelcolor::Rgb888;
use embedded_graphics::prelude::*;

/// A white `w` x `h` RGB image.
pub struct Canvas {
    w: u32,
    h: u32,
    rgb: Vec<u8>,
}

impl Canvas {
    /// A white canvas.
    pub fn new(w: u32, h: u32) -> Self {
        Self {
            w,
            h,
            rgb: vec![255; (w * h * 3) as usize],
        }
    }

    /// Writes the image to `path` as PNG (creating its directory).
    pub fn save_png(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = std::fs::File::create(path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        let mut enc = png::Encoder::new(std::io::BufWriter::new(file), self.w, self.h);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut writer = enc.write_header()?;
        writer.write_image_data(&self.rgb)?;
        writer.finish()?;
        Ok(())
    }
}

impl OriginDimensions for Canvas {
    fn size(&self) -> Size {
        Size::new(self.w, self.h)
    }
}

impl DrawTarget for Canvas {
    type Color = Rgb888;
    type Error = std::convert::Infallible;

    fn draw_iter<I: IntoIterator<Item = Pixel<Rgb888>>>(
        &mut self,
        pixels: I,
    ) -> Result<(), Self::Error> {
        for Pixel(p, c) in pixels {
            if p.x >= 0 && p.y >= 0 && (p.x as u32) < self.w && (p.y as u32) < self.h {
                let i = 3 * (p.y as usize * self.w as usize + p.x as usize);
                self.rgb[i..i + 3].copy_from_slice(&[c.r(), c.g(), c.b()]);
            }
        }
        Ok(())
    }
}
