//! The report as plain text (`rpctrace report` without `--json`).

use super::Report;

/// The share of the critical path in the step spans' own time from which the text says how
/// to trace what it is.
const UNTRACED_HINT: f64 = 0.15;

impl Report {
    /// The report as plain text.
    pub fn text(&self) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "{} steps, median {:.2} ms; clocks aligned within {:.0} us",
            self.steps, self.step_ms_median, self.clock_error_us
        );
        if !self.unaligned.is_empty() {
            let _ = writeln!(
                o,
                "ranks {:?} on their own clocks (rank 0's was never read): their times are \
                 not comparable with the others'",
                self.unaligned
            );
        }
        if !self.missing.is_empty() {
            let which = match self.missing_by_start.as_slice() {
                [] => format!("{:?}", self.missing),
                starts => (starts.iter())
                    .map(|(start, ranks)| format!("{ranks:?} in start {start}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            };
            let _ = writeln!(
                o,
                "no part from ranks {which} (killed outright, or their parts are on another \
                 host): what they did is not in this report"
            );
        }
        if let Some((w, n)) = &self.straggler {
            let _ = writeln!(
                o,
                "straggler: {w} (most time on the critical path in {n} of {} steps)",
                self.steps
            );
        }
        let slowest = (self.per_step.iter().enumerate())
            .max_by(|a, b| a.1.ms.total_cmp(&b.1.ms).then(b.0.cmp(&a.0)));
        if let (Some((k, s)), true) = (slowest, self.steps > 1) {
            let which = (s.number.filter(|&n| n != k as u64))
                .map_or(String::new(), |n| format!(" (recorded as step {n})"));
            let who = (s.straggler.as_ref()).map_or(String::new(), |(w, ms)| {
                format!(", {w} {ms:.2} ms of its critical path")
            });
            let _ = writeln!(o, "slowest: step {k}{which}, {:.2} ms{who}", s.ms);
        }
        let _ = writeln!(o, "critical path, summed over the steps:");
        for (w, s, c, ms, share) in self.critical.iter().take(8) {
            let _ = writeln!(
                o,
                "  {:>5.1} %  {ms:>10.2} ms  {w}: {s} ({c})",
                share * 100.0
            );
        }
        let untraced: f64 = (self.critical.iter())
            .filter(|(_, s, c, _, _)| s == "step" && c == "self")
            .map(|c| c.4)
            .sum();
        if untraced >= UNTRACED_HINT {
            let _ = writeln!(
                o,
                "  ({:.0} % is `step (self)`: time in the step spans that no span covers, the \
                 program's own\n   work; a `Cat::Compute` span around its forward pass, loss \
                 and update says which)",
                untraced * 100.0
            );
        }
        let _ = writeln!(o, "worker shares of a step (mean):");
        let _ = writeln!(
            o,
            "  {:<24} {:>6} {:>6} {:>8} {:>8} {:>7}",
            "worker", "busy", "comm", "waiting", "overlap", "bubble"
        );
        let pct = |x: Option<f64>| x.map_or("-".to_owned(), |v| format!("{:.0} %", v * 100.0));
        for w in &self.workers {
            let _ = writeln!(
                o,
                "  {:<24} {:>4.0} % {:>4.0} % {:>6.0} % {:>8} {:>7}",
                w.worker,
                w.busy * 100.0,
                w.communicating * 100.0,
                w.waiting * 100.0,
                pct(w.overlap),
                pct(w.pipeline_bubble)
            );
        }
        o
    }
}
