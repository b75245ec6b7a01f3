//! How a decision's reason writes its numbers: it is read in Events and `status.lastScale`.

/// A share as a percentage: one decimal below 10%, none above.
pub fn pct(share: f64) -> String {
    let p = share * 100.0;
    if p.abs() < 10.0 && (p - p.round()).abs() > 0.05 {
        format!("{p:.1}%")
    } else {
        format!("{p:.0}%")
    }
}

/// A rate with thousands separators: 2400.4 → "2,400".
pub fn count(x: f64) -> String {
    if x.is_finite() && x.abs() < 10.0 && (x - x.round()).abs() > 0.05 {
        return format!("{x:.1}");
    }
    let n = x.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// Appends each of `notes` to `reason`, `; `-separated.
pub(super) fn append_notes(reason: &mut String, notes: &[String]) {
    for note in notes {
        reason.push_str("; ");
        reason.push_str(note);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_read_as_numbers() {
        assert_eq!(count(2400.4), "2,400");
        assert_eq!(count(1_234_567.0), "1,234,567");
        assert_eq!(count(210.0), "210");
        assert_eq!(pct(0.22), "22%");
        assert_eq!(pct(0.018), "1.8%");
        assert_eq!(pct(0.05), "5%");
    }
}
