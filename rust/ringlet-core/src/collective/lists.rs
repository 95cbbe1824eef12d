//! The list forms of torch.distributed's collectives (`all_gather` into a
//! list, `gather`, `scatter`, `all_to_all` of lists, `reduce_scatter` of a
//! list) as one engine collective on flat buffers: the caller stages the
//! list's inputs back to back into `send` and copies `recv` out into its
//! outputs (`buf::stage` / `buf::unstage` do both for buffers handed over as
//! addresses, which may alias each other). The lengths say where each list
//! entry lies. A size mismatch between ranks names the user's collective, as
//! the Python process group does.

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::group::Communicator;

/// Which list form, with its root or reduce op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListOp {
    /// One input; one output per rank (rank r's input; lengths may differ:
    /// every rank then sends its input to every rank).
    AllGather,
    /// One input; on `root` one output per rank, elsewhere none.
    Gather { root: usize },
    /// On `root` one input per rank, elsewhere none; one output.
    Scatter { root: usize },
    /// One input and one output per rank.
    AllToAll,
    /// One input per rank (block r goes to rank r); one output, this rank's
    /// block reduced (blocks of different lengths: all reduced, this rank's
    /// kept).
    ReduceScatter(ReduceOp),
}

impl ListOp {
    /// The list form torch names `kind` (`all_gather`, `gather`, `scatter`,
    /// `all_to_all`, `reduce_scatter`), with the root of `gather` and
    /// `scatter` and the reduce op of `reduce_scatter`; None for another name.
    pub fn named(kind: &str, root: usize, red: ReduceOp) -> Option<ListOp> {
        [
            ListOp::AllGather,
            ListOp::Gather { root },
            ListOp::Scatter { root },
            ListOp::AllToAll,
            ListOp::ReduceScatter(red),
        ]
        .into_iter()
        .find(|op| op.rule().0 == kind)
    }

    /// The user's collective, and what its sizes must satisfy across ranks.
    fn rule(self) -> (&'static str, &'static str) {
        match self {
            ListOp::AllGather => (
                "all_gather",
                "output tensor r must have rank r's input size",
            ),
            ListOp::Gather { .. } => (
                "gather",
                "the root's output tensor r must have rank r's input size",
            ),
            ListOp::Scatter { .. } => (
                "scatter",
                "rank r's output must have the size of the root's input tensor r",
            ),
            ListOp::AllToAll => ("all_to_all", "output r must have rank r's input size"),
            ListOp::ReduceScatter(_) => {
                ("reduce_scatter", "input block r must match on every rank")
            }
        }
    }
}

impl Communicator {
    /// Runs list form `op`: `send` holds the inputs back to back (their byte
    /// lengths `in_lens`), `recv` receives the outputs back to back (their
    /// byte lengths `out_lens`).
    pub fn list_collective(
        &mut self,
        op: ListOp,
        send: &[u8],
        in_lens: &[usize],
        recv: &mut [u8],
        out_lens: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let (what, _) = op.rule();
        let (p, me) = (self.size(), self.rank());
        let elems = |lens: &[usize]| -> Result<Vec<usize>> {
            lens.iter()
                .map(|&n| super::elements(n, dtype, what))
                .collect()
        };
        let (ins, outs) = (elems(in_lens)?, elems(out_lens)?);
        if in_lens.iter().sum::<usize>() != send.len()
            || out_lens.iter().sum::<usize>() != recv.len()
        {
            return Err(Error::InvalidArgument(format!(
                "rank {me}: {what}: the list's lengths do not add up to its flat buffers"
            )));
        }
        let want = |what_list: &str, got: usize, n: usize| -> Result<()> {
            if got == n {
                return Ok(());
            }
            Err(Error::InvalidArgument(format!(
                "rank {me}: {what} needs {n} {what_list} tensors, got {got}"
            )))
        };
        let root_of = |root: usize| -> Result<usize> {
            if root < p {
                return Ok(root);
            }
            Err(Error::InvalidArgument(format!(
                "rank {me}: {what}: invalid root rank: {root} (a group of {p} ranks)"
            )))
        };
        let result = match op {
            ListOp::AllGather => {
                want("input", ins.len(), 1)?;
                want("output", outs.len(), p)?;
                if outs.iter().all(|&n| n == ins[0]) {
                    self.all_gather(send, recv, dtype)
                } else {
                    let every = send.repeat(p);
                    self.all_to_all_v(&every, &vec![ins[0]; p], recv, &outs, dtype)
                }
            }
            ListOp::Gather { root } => {
                let root = root_of(root)?;
                want("input", ins.len(), 1)?;
                want("output", outs.len(), if me == root { p } else { 0 })?;
                let mut sends = vec![0; p];
                sends[root] = ins[0];
                let recvs = if me == root { outs } else { vec![0; p] };
                self.all_to_all_v(send, &sends, recv, &recvs, dtype)
            }
            ListOp::Scatter { root } => {
                let root = root_of(root)?;
                want("input", ins.len(), if me == root { p } else { 0 })?;
                want("output", outs.len(), 1)?;
                let sends = if me == root { ins } else { vec![0; p] };
                let mut recvs = vec![0; p];
                recvs[root] = outs[0];
                self.all_to_all_v(send, &sends, recv, &recvs, dtype)
            }
            ListOp::AllToAll => {
                want("input", ins.len(), p)?;
                want("output", outs.len(), p)?;
                self.all_to_all_v(send, &ins, recv, &outs, dtype)
            }
            ListOp::ReduceScatter(red) => {
                want("input", ins.len(), p)?;
                want("output", outs.len(), 1)?;
                if ins[me] != outs[0] {
                    return Err(Error::InvalidArgument(format!(
                        "rank {me}: reduce_scatter output holds {} elements but this rank's \
                         input block holds {}",
                        outs[0], ins[me]
                    )));
                }
                if ins.iter().all(|&n| n == ins[0]) {
                    self.reduce_scatter(send, recv, dtype, red)
                } else {
                    let mut all = send.to_vec();
                    self.all_reduce(&mut all, dtype, red).map(|()| {
                        let start: usize = in_lens[..me].iter().sum();
                        recv.copy_from_slice(&all[start..start + in_lens[me]]);
                    })
                }
            }
        };
        result.map_err(|e| match e {
            Error::Mismatch { rank, detail } => {
                let (what, rule) = op.rule();
                Error::Mismatch {
                    rank,
                    detail: format!(
                        "{what}: the ranks' tensor sizes do not fit together ({rule}); \
                         the engine found: {detail}"
                    ),
                }
            }
            other => other,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_forms_are_found_by_torchs_names() {
        let max = ReduceOp::Max;
        assert_eq!(ListOp::named("all_gather", 1, max), Some(ListOp::AllGather));
        assert_eq!(
            ListOp::named("gather", 1, max),
            Some(ListOp::Gather { root: 1 })
        );
        assert_eq!(
            ListOp::named("scatter", 2, max),
            Some(ListOp::Scatter { root: 2 })
        );
        assert_eq!(ListOp::named("all_to_all", 0, max), Some(ListOp::AllToAll));
        assert_eq!(
            ListOp::named("reduce_scatter", 0, max),
            Some(ListOp::ReduceScatter(max))
        );
        assert_eq!(ListOp::named("all_reduce", 0, max), None);
    }
}
