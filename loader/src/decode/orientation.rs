//! EXIF orientation: read from a JPEG's APP1 segment or a PNG's eXIf chunk (WebP gets it from
//! the `image` crate) and applied to decoded RGB8 pixels, so that samples look the way cameras
//! meant.

/// EXIF orientation tag values 1–8.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Orientation {
    #[default]
    Normal,
    FlipH,
    Rotate180,
    FlipV,
    /// Transpose (flip over the main diagonal).
    Transpose,
    Rotate90,
    Transverse,
    Rotate270,
}

impl Orientation {
    pub fn from_exif(v: u16) -> Orientation {
        match v {
            2 => Orientation::FlipH,
            3 => Orientation::Rotate180,
            4 => Orientation::FlipV,
            5 => Orientation::Transpose,
            6 => Orientation::Rotate90,
            7 => Orientation::Transverse,
            8 => Orientation::Rotate270,
            _ => Orientation::Normal,
        }
    }

    /// Whether width and height trade places.
    pub fn swaps_axes(self) -> bool {
        matches!(
            self,
            Orientation::Transpose
                | Orientation::Rotate90
                | Orientation::Transverse
                | Orientation::Rotate270
        )
    }
}

/// A rectangle of pixels: `x`..`x + width` by `y`..`y + height`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rect {
    pub x: u32,
    pub y: u32,
    pub width: u32,
    pub height: u32,
}

impl Rect {
    /// The part of a `w` x `h` image from corner (x0, y0) to (x1, y1), exclusive; `None` when
    /// it is empty or the whole image (nothing to save by decoding only it).
    pub fn part_of((x0, y0): (u32, u32), (x1, y1): (u32, u32), (w, h): (u32, u32)) -> Option<Rect> {
        let whole = x0 == 0 && y0 == 0 && x1 >= w && y1 >= h;
        (x0 < x1 && y0 < y1 && !whole).then(|| Rect {
            x: x0,
            y: y0,
            width: x1 - x0,
            height: y1 - y0,
        })
    }
}

impl Orientation {
    /// The orientation that undoes this one.
    pub fn inverse(self) -> Orientation {
        match self {
            Orientation::Rotate90 => Orientation::Rotate270,
            Orientation::Rotate270 => Orientation::Rotate90,
            o => o,
        }
    }

    /// Where `r`, a rectangle of a `w` x `h` image, lands once [`apply_orientation`] has turned
    /// that image (the same pixel mapping, for rectangles).
    pub fn map_rect(self, r: Rect, w: u32, h: u32) -> Rect {
        let flip_x = |r: Rect| w - r.x - r.width;
        let flip_y = |r: Rect| h - r.y - r.height;
        let (x, y) = match self {
            Orientation::Normal => (r.x, r.y),
            Orientation::FlipH => (flip_x(r), r.y),
            Orientation::Rotate180 => (flip_x(r), flip_y(r)),
            Orientation::FlipV => (r.x, flip_y(r)),
            Orientation::Transpose => (r.y, r.x),
            Orientation::Rotate90 => (flip_y(r), r.x),
            Orientation::Transverse => (flip_y(r), flip_x(r)),
            Orientation::Rotate270 => (r.y, flip_x(r)),
        };
        let (width, height) = if self.swaps_axes() {
            (r.height, r.width)
        } else {
            (r.width, r.height)
        };
        Rect {
            x,
            y,
            width,
            height,
        }
    }
}

/// Finds the orientation tag in a JPEG's EXIF (APP1) segment; Normal when absent or unreadable,
/// because a broken EXIF block should not cost the sample.
pub fn exif_orientation(jpeg: &[u8]) -> Orientation {
    let mut pos = 2;
    while pos + 4 <= jpeg.len() {
        if jpeg[pos] != 0xFF {
            return Orientation::Normal;
        }
        let marker = jpeg[pos + 1];
        // Fill bytes between markers.
        if marker == 0xFF {
            pos += 1;
            continue;
        }
        // Start of scan or end of image: no EXIF before the pixel data.
        if marker == 0xDA || marker == 0xD9 {
            return Orientation::Normal;
        }
        let len = usize::from(u16::from_be_bytes([jpeg[pos + 2], jpeg[pos + 3]]));
        let seg_start = pos + 4;
        let seg_end = (pos + 2 + len).min(jpeg.len());
        if marker == 0xE1 && seg_end > seg_start {
            let seg = &jpeg[seg_start..seg_end];
            if let Some(tiff) = seg.strip_prefix(b"Exif\0\0") {
                return tiff_orientation(tiff).unwrap_or_default();
            }
        }
        pos = pos + 2 + len;
    }
    Orientation::Normal
}

/// Finds the orientation tag in a PNG's `eXIf` chunk, which must precede the pixel data
/// (`IDAT`); Normal when absent or unreadable. Walks chunk headers only: no CRC, no inflate.
pub fn png_exif_orientation(png: &[u8]) -> Orientation {
    // Signature (8 bytes), then chunks: length (4, big-endian), type (4), data, CRC (4).
    let mut pos = 8;
    while let Some(header) = png.get(pos..pos + 8) {
        let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let kind = &header[4..8];
        if kind == b"IDAT" || kind == b"IEND" {
            break;
        }
        let start = pos + 8;
        if kind == b"eXIf" {
            let Some(data) = png.get(start..start.saturating_add(len)) else {
                break;
            };
            // Some writers keep the JPEG APP1 prefix; the PNG spec stores the TIFF block bare.
            let tiff = data.strip_prefix(b"Exif\0\0").unwrap_or(data);
            return tiff_orientation(tiff).unwrap_or_default();
        }
        pos = start.saturating_add(len).saturating_add(4);
    }
    Orientation::Normal
}

/// Reads tag 0x0112 from IFD0 of a TIFF block.
pub(crate) fn tiff_orientation(tiff: &[u8]) -> Option<Orientation> {
    let le = match tiff.get(0..2)? {
        b"II" => true,
        b"MM" => false,
        _ => return None,
    };
    let u16_at = |i: usize| -> Option<u16> {
        let b = tiff.get(i..i + 2)?;
        Some(if le {
            u16::from_le_bytes([b[0], b[1]])
        } else {
            u16::from_be_bytes([b[0], b[1]])
        })
    };
    let u32_at = |i: usize| -> Option<u32> {
        let b = tiff.get(i..i + 4)?;
        Some(if le {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]])
        } else {
            u32::from_be_bytes([b[0], b[1], b[2], b[3]])
        })
    };
    let ifd = usize::try_from(u32_at(4)?).ok()?;
    let count = usize::from(u16_at(ifd)?);
    for i in 0..count.min(512) {
        let entry = ifd + 2 + i * 12;
        if u16_at(entry)? == 0x0112 {
            return Some(Orientation::from_exif(u16_at(entry + 8)?));
        }
    }
    None
}

/// Applies `o` to packed RGB8 `src` (w x h), writing into `dst`; returns the new size.
pub fn apply_orientation(
    src: &[u8],
    w: u32,
    h: u32,
    o: Orientation,
    dst: &mut Vec<u8>,
) -> (u32, u32) {
    let (w, h) = (w as usize, h as usize);
    let (ow, oh) = if o.swaps_axes() { (h, w) } else { (w, h) };
    dst.clear();
    dst.resize(ow * oh * 3, 0);
    for y in 0..oh {
        for x in 0..ow {
            // Source pixel for output (x, y).
            let (sx, sy) = match o {
                Orientation::Normal => (x, y),
                Orientation::FlipH => (w - 1 - x, y),
                Orientation::Rotate180 => (w - 1 - x, h - 1 - y),
                Orientation::FlipV => (x, h - 1 - y),
                Orientation::Transpose => (y, x),
                Orientation::Rotate90 => (y, h - 1 - x),
                Orientation::Transverse => (w - 1 - y, h - 1 - x),
                Orientation::Rotate270 => (w - 1 - y, x),
            };
            let s = (sy * w + sx) * 3;
            let d = (y * ow + x) * 3;
            dst[d..d + 3].copy_from_slice(&src[s..s + 3]);
        }
    }
    (ow as u32, oh as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2x1 image: red, green.
    const RG: [u8; 6] = [255, 0, 0, 0, 255, 0];

    #[test]
    fn rotate90_turns_a_row_into_a_column() {
        let mut out = Vec::new();
        let (w, h) = apply_orientation(&RG, 2, 1, Orientation::Rotate90, &mut out);
        assert_eq!((w, h), (1, 2));
        // Clockwise: the left pixel (red) ends on top.
        assert_eq!(out, vec![255, 0, 0, 0, 255, 0]);
        let (w, h) = apply_orientation(&RG, 2, 1, Orientation::Rotate270, &mut out);
        assert_eq!((w, h), (1, 2));
        assert_eq!(out, vec![0, 255, 0, 255, 0, 0]);
        apply_orientation(&RG, 2, 1, Orientation::FlipH, &mut out);
        assert_eq!(out, vec![0, 255, 0, 255, 0, 0]);
    }

    #[test]
    fn map_rect_follows_the_pixels() {
        // A 5x3 image whose pixel values are their index; a 2x1 rectangle at (1, 2).
        let (w, h) = (5u32, 3u32);
        let src: Vec<u8> = (0..w * h).flat_map(|i| [i as u8, 0, 0]).collect();
        let r = Rect {
            x: 1,
            y: 2,
            width: 2,
            height: 1,
        };
        let inside: Vec<u8> = vec![11, 12];
        for v in 1..=8 {
            let o = Orientation::from_exif(v);
            let mut out = Vec::new();
            let (ow, _) = apply_orientation(&src, w, h, o, &mut out);
            let m = o.map_rect(r, w, h);
            let mut got: Vec<u8> = (m.y..m.y + m.height)
                .flat_map(|y| (m.x..m.x + m.width).map(move |x| (y, x)))
                .map(|(y, x)| out[((y * ow + x) * 3) as usize])
                .collect();
            got.sort();
            assert_eq!(got, inside, "{o:?}");
            let (sw, sh) = if o.swaps_axes() { (h, w) } else { (w, h) };
            assert_eq!(o.inverse().map_rect(m, sw, sh), r, "{o:?}");
        }
    }

    #[test]
    fn reads_orientation_from_big_endian_exif() {
        // TIFF header MM, IFD at 8 with one entry: 0x0112 SHORT 1 value 6.
        let mut tiff = b"MM\0\x2a\0\0\0\x08\0\x01".to_vec();
        tiff.extend_from_slice(&[0x01, 0x12, 0, 3, 0, 0, 0, 1, 0, 6, 0, 0]);
        let mut jpeg = vec![0xFF, 0xD8, 0xFF, 0xE1];
        let len = (2 + 6 + tiff.len()) as u16;
        jpeg.extend_from_slice(&len.to_be_bytes());
        jpeg.extend_from_slice(b"Exif\0\0");
        jpeg.extend_from_slice(&tiff);
        jpeg.extend_from_slice(&[0xFF, 0xD9]);
        assert_eq!(exif_orientation(&jpeg), Orientation::Rotate90);
    }
}
