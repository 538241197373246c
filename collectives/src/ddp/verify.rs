//! DDP-6: the replicas' models agree before anything is broadcast. Every member gathers every
//! member's parameter count, then each parameter's type and shape; a difference fails the
//! wrapping on every member with one message (every member judges the same gathered data),
//! naming the parameter and the ranks. Without it a member with a parameter of another shape
//! failed its broadcast while the root went on, and a member with one parameter too many
//! waited in a broadcast that nobody else called.

use candle_core::{DType, Device, Tensor, Var};

use crate::group::{CollectiveError, ProcessGroup};

/// Dimensions a parameter's row carries one by one; more are folded into the last.
const DIMS: usize = 8;

/// Fails unless every member of `group` wraps parameters of the same types and shapes, in
/// the same order, as `vars`.
pub(super) async fn same_models(group: &ProcessGroup, vars: &[Var]) -> Result<(), CollectiveError> {
    let count = Tensor::new(&[vars.len() as i64], &Device::Cpu)?;
    let counts: Vec<i64> = gathered(group, &count).await?;
    if let Some(r) = counts.iter().position(|&c| c != counts[0]) {
        let ranks = group.ranks();
        return Err(differ(
            group,
            format!(
                "rank {} has {} parameters and rank {} has {}",
                ranks[0], counts[0], ranks[r], counts[r]
            ),
        ));
    }
    if vars.is_empty() {
        return Ok(());
    }
    let rows: Vec<i64> = vars.iter().flat_map(|v| row(v.as_tensor())).collect();
    let mine = Tensor::from_vec(rows, (vars.len(), DIMS + 2), &Device::Cpu)?;
    let all = gathered(group, &mine).await?;
    let width = vars.len() * (DIMS + 2);
    let first = &all[..width];
    for (r, theirs) in all.chunks(width).enumerate().skip(1) {
        let rows = first.chunks(DIMS + 2).zip(theirs.chunks(DIMS + 2));
        if let Some((i, (a, b))) = rows.enumerate().find(|(_, (a, b))| a != b) {
            let ranks = group.ranks();
            return Err(differ(
                group,
                format!(
                    "parameter {i} is {} on rank {} and {} on rank {}",
                    describe(a),
                    ranks[0],
                    describe(b),
                    ranks[r]
                ),
            ));
        }
    }
    Ok(())
}

/// Every member's `t`, concatenated in rank order, as integers.
async fn gathered(group: &ProcessGroup, t: &Tensor) -> Result<Vec<i64>, CollectiveError> {
    let all = group.all_gather(t).await?;
    Ok(Tensor::cat(&all, 0)?.flatten_all()?.to_vec1()?)
}

/// A parameter as integers: its type, its rank, its dimensions (padded with zeros).
fn row(t: &Tensor) -> Vec<i64> {
    let dims = t.dims();
    let mut row = vec![DTYPES
        .iter()
        .position(|&d| d == t.dtype())
        .map_or(-1, |i| i as i64)];
    row.push(dims.len() as i64);
    let mut shown: Vec<i64> = dims.iter().take(DIMS).map(|&d| d as i64).collect();
    if dims.len() > DIMS {
        shown[DIMS - 1] = dims[DIMS - 1..].iter().product::<usize>() as i64;
    }
    shown.resize(DIMS, 0);
    row.extend(shown);
    row
}

/// A row as words: "a F32 tensor of shape [8, 3]".
fn describe(row: &[i64]) -> String {
    let dtype = usize::try_from(row[0])
        .ok()
        .and_then(|i| DTYPES.get(i))
        .map_or("other".to_owned(), |d| format!("{d:?}"));
    let rank = (row[1].max(0) as usize).min(DIMS);
    format!("a {dtype} tensor of shape {:?}", &row[2..2 + rank])
}

const DTYPES: [DType; 7] = [
    DType::U8,
    DType::U32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

fn differ(group: &ProcessGroup, why: String) -> CollectiveError {
    CollectiveError::Failed {
        op: "DistributedDataParallel::new",
        members: group.ranks().to_vec(),
        message: format!("the replicas' models differ: {why}"),
    }
}
