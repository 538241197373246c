//! NC-1's agreement on a communicator (`nccl/`): every member of an operation tells the others
//! the generation of the communicator it holds (0: none), and each decides alike from the same
//! numbers whether the group keeps it or builds a new one, and which number the new one gets.
//! A plain function of those numbers, so that it is tested in every build (NCCL's code needs
//! the `nccl` feature and a GPU).

/// `None` when every member holds the same communicator (one generation, not 0): it is kept.
/// Otherwise `Some(g)`: every member builds a new communicator and numbers it `g`, one past
/// the largest number any member holds, so that members which had gone apart (one aborted a
/// communicator the others still held) agree again from the next operation on.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) fn agree(mine: u64, theirs: &[u64]) -> Option<u64> {
    if mine != 0 && theirs.iter().all(|&g| g == mine) {
        return None;
    }
    Some(theirs.iter().copied().fold(mine, u64::max) + 1)
}

#[cfg(test)]
mod tests {
    use super::agree;

    /// The same answer on every member, and after a rebuild they are equal again.
    #[test]
    fn members_agree_on_keeping_or_rebuilding_and_on_the_new_number() {
        assert_eq!(agree(3, &[3, 3]), None);
        assert_eq!(agree(0, &[0, 0]), Some(1));
        // Member 0 aborted its communicator (0), the others still hold generation 2: every
        // member builds generation 3 (a member's own count of rebuilds does not matter).
        let held = [0u64, 2, 2];
        let answers: Vec<_> = (0..3)
            .map(|i| {
                let theirs: Vec<u64> = (0..3).filter(|&j| j != i).map(|j| held[j]).collect();
                agree(held[i], &theirs)
            })
            .collect();
        assert_eq!(answers, vec![Some(3); 3]);
        assert_eq!(agree(3, &[3, 3]), None, "equal again after the rebuild");
        assert_eq!(agree(7, &[2, 9]), Some(10));
    }
}
