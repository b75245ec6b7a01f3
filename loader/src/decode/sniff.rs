//! Format detection from magic bytes; the object's key or Content-Type is never trusted.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    Jpeg,
    Png,
    WebP,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Jpeg => "jpeg",
            Format::Png => "png",
            Format::WebP => "webp",
        }
    }
}

pub const PNG_MAGIC: &[u8; 8] = b"\x89PNG\r\n\x1a\n";

pub fn sniff(data: &[u8]) -> Option<Format> {
    if data.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some(Format::Jpeg)
    } else if data.starts_with(PNG_MAGIC) {
        Some(Format::Png)
    } else if data.len() >= 12 && &data[0..4] == b"RIFF" && &data[8..12] == b"WEBP" {
        Some(Format::WebP)
    } else {
        None
    }
}

/// A short description of bytes that are no supported image, for the log line.
pub fn describe_unknown(data: &[u8]) -> &'static str {
    let head = &data[..data.len().min(512)];
    let trimmed = head
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .map_or(&head[..0], |i| &head[i..]);
    if trimmed.starts_with(b"GIF8") {
        "gif"
    } else if trimmed.starts_with(b"BM") {
        "bmp"
    } else if trimmed.starts_with(b"<") {
        // HTML error pages and XML error bodies from proxies or S3 itself.
        "html or xml"
    } else if head
        .iter()
        .all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace() || *b >= 0x80)
    {
        "text"
    } else {
        "unknown binary"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sniffs_magic_bytes() {
        assert_eq!(sniff(&[0xFF, 0xD8, 0xFF, 0xE0]), Some(Format::Jpeg));
        assert_eq!(sniff(b"\x89PNG\r\n\x1a\nrest"), Some(Format::Png));
        assert_eq!(sniff(b"RIFF\0\0\0\0WEBPVP8 "), Some(Format::WebP));
        assert_eq!(sniff(b"<!DOCTYPE html>"), None);
        assert_eq!(
            describe_unknown(b"  <html><body>503</body></html>"),
            "html or xml"
        );
        assert_eq!(describe_unknown(b"hello world\n"), "text");
        assert_eq!(describe_unknown(b"GIF89a...."), "gif");
    }
}
