//! RDV-9: the failure reports a member sent, kept until the group has decided on the
//! incarnation each names. A link to the rendezvous that breaks may lose the reports still on
//! their way (TCP took them from the sender, the connection died before the rendezvous read
//! them), and a member's detector decides once (LIVE-1): so on the next link each report is
//! sent again while the rendezvous's table still counts that incarnation alive. The rendezvous
//! counts each reporter once (RDV-4), so a report it had read already changes nothing.

use super::{Report, Standing, Update, View};

/// Reports kept at most: a member reports each incarnation of each peer at most once, so this
/// bounds only a group of thousands with every peer failed at once (the oldest go first).
const MOST: usize = 1024;

/// The failure reports sent and not yet settled: `(rank, incarnation, cause)`.
#[derive(Debug, Default)]
pub(super) struct Unsettled(Vec<(u32, u64, String)>);

impl Unsettled {
    /// Keeps `report` if it is a failure report (a leave needs no resend: a member that leaves
    /// waits for the rendezvous's answer).
    pub(super) fn sent(&mut self, report: &Report) {
        if let Report::Failed {
            rank,
            incarnation,
            cause,
        } = report
        {
            if self.0.len() == MOST {
                self.0.remove(0);
            }
            self.0.push((*rank, *incarnation, cause.clone()));
        }
    }

    /// Forgets the reports `update` settles: the incarnation failed or left, or a later one
    /// holds the rank.
    pub(super) fn heard(&mut self, update: &Update) {
        match update {
            Update::Failed {
                rank, incarnation, ..
            }
            | Update::Left { rank, incarnation } => {
                self.0.retain(|(r, i, _)| r != rank || i > incarnation);
            }
            Update::Joined { rank, endpoint } => {
                self.0
                    .retain(|(r, i, _)| r != rank || *i >= endpoint.incarnation);
            }
            Update::Alive => {}
        }
    }

    /// The reports to send again on a new link, given the group as the rendezvous sent it
    /// then: those whose incarnation it still counts alive (the others are forgotten).
    pub(super) fn resend(&mut self, view: &View) -> Vec<Report> {
        self.0.retain(|(rank, incarnation, _)| {
            view.members.get(*rank as usize).is_some_and(|m| {
                m.standing == Standing::Alive && m.endpoint.incarnation == *incarnation
            })
        });
        self.0
            .iter()
            .map(|(rank, incarnation, cause)| Report::Failed {
                rank: *rank,
                incarnation: *incarnation,
                cause: cause.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::Member;
    use super::*;

    fn failed(rank: u32, incarnation: u64) -> Report {
        Report::Failed {
            rank,
            incarnation,
            cause: format!("{rank}.{incarnation} silent"),
        }
    }

    /// A table of `ranks` members, each `(incarnation, standing)`.
    fn view(ranks: &[(u64, Standing)]) -> View {
        let members = ranks
            .iter()
            .map(|(incarnation, standing)| {
                let mut m = Member::vacant();
                m.endpoint.incarnation = *incarnation;
                m.standing = standing.clone();
                m
            })
            .collect();
        View {
            job: String::new(),
            named: None,
            sink: None,
            generation: 0,
            members,
        }
    }

    /// RDV-9: a report is sent again while the group counts its incarnation alive, and
    /// forgotten once an update or the table settles it.
    #[test]
    fn reports_are_resent_until_the_group_decides() {
        let mut u = Unsettled::default();
        u.sent(&failed(1, 0));
        u.sent(&failed(2, 3));
        u.sent(&Report::Leaving);
        let alive = view(&[
            (0, Standing::Alive),
            (0, Standing::Alive),
            (3, Standing::Alive),
        ]);
        assert_eq!(u.resend(&alive).len(), 2);
        // The group declared 2.3 failed: only 1.0 is left.
        u.heard(&Update::Failed {
            rank: 2,
            incarnation: 3,
            cause: String::new(),
        });
        let again = u.resend(&alive);
        assert!(matches!(
            again[..],
            [Report::Failed {
                rank: 1,
                incarnation: 0,
                ..
            }]
        ));
        // A new incarnation of rank 1 in the table settles the report on the old one.
        let replaced = view(&[
            (0, Standing::Alive),
            (1, Standing::Alive),
            (3, Standing::Alive),
        ]);
        assert!(u.resend(&replaced).is_empty());
        assert!(u.resend(&alive).is_empty(), "forgotten for good");
    }
}
