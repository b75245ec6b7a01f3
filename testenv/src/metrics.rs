//! The tests' one reader of the Prometheus text format that the loader, the sidecar, the
//! operator and the simulated node-exporters serve on `/metrics`, on the `prometheus-parse`
//! crate.

use prometheus_parse::{Sample, Scrape, Value};

/// One scrape's scalar series: counters, gauges, untyped samples, and a histogram's `_sum` and
/// `_count` (its buckets are not single series here).
pub struct Exposition {
    samples: Vec<Sample>,
}

impl Exposition {
    /// Lines that are not samples are skipped (Prometheus would refuse the scrape): a series
    /// read from them is absent, not an error.
    pub fn parse(text: &str) -> Self {
        Self {
            samples: samples(text.lines()),
        }
    }

    /// One series, written as the text writes it: `name` or `name{label="value",...}`, labels
    /// in any order and all of them.
    pub fn get(&self, series: &str) -> Option<f64> {
        let wanted = samples(std::iter::once(format!("{series} 0").as_str())).pop()?;
        self.samples
            .iter()
            .find(|s| s.metric == wanted.metric && s.labels == wanted.labels)
            .and_then(scalar)
    }

    /// The sum over every series of `name` whose labels include all of `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|s| s.metric == name)
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .filter_map(scalar)
            .sum()
    }
}

/// One series' value in exposition `text` (see [`Exposition::get`]); 0 when absent, as a
/// counter nothing has incremented yet or a labelled child not yet created is.
pub fn metric(text: &str, series: &str) -> f64 {
    Exposition::parse(text).get(series).unwrap_or(0.0)
}

fn samples<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<Sample> {
    // Lines read from memory never fail, so neither does the parse.
    Scrape::parse(lines.map(|l| Ok(l.to_owned())))
        .map(|scrape| scrape.samples)
        .unwrap_or_default()
}

fn scalar(sample: &Sample) -> Option<f64> {
    match sample.value {
        Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => Some(v),
        Value::Histogram(_) | Value::Summary(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What prometheus-client (OpenMetrics) writes for the loader.
    const LOADER: &str = "\
# HELP stoker_loader_skips Samples skipped.
# TYPE stoker_loader_skips counter
stoker_loader_skips_total{reason=\"not_found\"} 2
stoker_loader_skips_total{reason=\"too_large\",bucket=\"data\"} 3
# TYPE stoker_loader_inflight_batches gauge
stoker_loader_inflight_batches 1
# TYPE stoker_loader_decode_seconds histogram
stoker_loader_decode_seconds_bucket{le=\"0.1\"} 4
stoker_loader_decode_seconds_bucket{le=\"+Inf\"} 5
stoker_loader_decode_seconds_sum 0.7
stoker_loader_decode_seconds_count 5
# EOF
";

    #[test]
    fn a_series_is_found_by_name_and_all_its_labels_in_any_order() {
        let m = Exposition::parse(LOADER);
        assert_eq!(m.get("stoker_loader_inflight_batches"), Some(1.0));
        assert_eq!(
            m.get("stoker_loader_skips_total{reason=\"not_found\"}"),
            Some(2.0)
        );
        assert_eq!(
            m.get("stoker_loader_skips_total{bucket=\"data\",reason=\"too_large\"}"),
            Some(3.0)
        );
        assert_eq!(
            m.get("stoker_loader_skips_total{reason=\"too_large\"}"),
            None
        );
        assert_eq!(m.get("stoker_loader_skips_total"), None);
        assert_eq!(m.get("stoker_loader_decode_seconds_count"), Some(5.0));
        assert_eq!(m.get("stoker_loader_decode_seconds_sum"), Some(0.7));
    }

    #[test]
    fn sum_adds_the_series_whose_labels_match() {
        let m = Exposition::parse(LOADER);
        assert_eq!(m.sum("stoker_loader_skips_total", &[]), 5.0);
        assert_eq!(
            m.sum("stoker_loader_skips_total", &[("reason", "too_large")]),
            3.0
        );
        assert_eq!(
            m.sum("stoker_loader_skips_total", &[("reason", "other")]),
            0.0
        );
        assert_eq!(m.sum("stoker_absent_total", &[]), 0.0);
    }

    #[test]
    fn an_absent_series_reads_zero() {
        assert_eq!(
            metric(LOADER, "stoker_loader_skips_total{reason=\"not_found\"}"),
            2.0
        );
        assert_eq!(
            metric(LOADER, "stoker_loader_skips_total{reason=\"corrupt\"}"),
            0.0
        );
        assert_eq!(metric("<html>not metrics</html>", "up"), 0.0);
    }
}
