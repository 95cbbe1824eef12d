//! Where the ranks of a communicator spanning hosts sit, and which channels
//! each carries across hosts: the layout behind the two-level collectives
//! (see `hierarchy` for the channels and the pipeline that use it). Plain
//! data and arithmetic, checked once when the levels are attached.

use crate::error::{Error, Result};
use std::ops::Range;

/// Where every rank sits and which channels it carries.
pub(crate) struct Plan {
    /// Group ranks of each host, in local-rank order.
    pub(crate) layout: Vec<Vec<usize>>,
    /// This rank's host and local index.
    pub(crate) host: usize,
    pub(crate) index: usize,
    /// Channels per cross-host buffer: the lcm of the hosts' rank counts.
    pub(crate) channels: usize,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Channels above this many would make pieces too fine (uneven hosts with
/// co-prime rank counts); such layouts are refused and stay flat.
const MAX_CHANNELS: usize = 1 << 10;

impl Plan {
    /// Checks that `layout` partitions the `size` ranks into hosts, that
    /// `rank` is local rank `local_rank` of its host and that the local
    /// communicator (`local_size` ranks) has that host's size.
    pub(crate) fn new(
        rank: usize,
        size: usize,
        local_rank: usize,
        local_size: usize,
        layout: Vec<Vec<usize>>,
    ) -> Result<Plan> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("attach_levels: {why}")));
        let mut seen = vec![false; size];
        for r in layout.iter().flatten() {
            if *r >= size || seen[*r] {
                return bad(format!("rank {r} is out of range or on two hosts"));
            }
            seen[*r] = true;
        }
        if seen.iter().any(|s| !s) || layout.len() < 2 || layout.iter().any(Vec::is_empty) {
            return bad(format!(
                "the layout {layout:?} must put each of the {size} ranks on one of at least two hosts"
            ));
        }
        let Some(host) = layout.iter().position(|g| g.contains(&rank)) else {
            return bad(format!("rank {rank} is on no host"));
        };
        let index = layout[host].iter().position(|&r| r == rank).unwrap_or(0);
        if local_size != layout[host].len() || local_rank != index {
            return bad(format!(
                "the local communicator is rank {local_rank} of {local_size} but the layout puts rank {rank} at {index} of {}",
                layout[host].len()
            ));
        }
        let channels = layout
            .iter()
            .map(Vec::len)
            .fold(1, |c, l| c / gcd(c, l) * l);
        if channels > MAX_CHANNELS {
            return bad(format!(
                "hosts of {:?} ranks need {channels} channels (at most {MAX_CHANNELS})",
                layout.iter().map(Vec::len).collect::<Vec<_>>()
            ));
        }
        Ok(Plan {
            layout,
            host,
            index,
            channels,
        })
    }

    pub(crate) fn hosts(&self) -> usize {
        self.layout.len()
    }

    /// Ranks on host `h`.
    pub(crate) fn width(&self, h: usize) -> usize {
        self.layout[h].len()
    }

    /// Ranks on this host.
    pub(crate) fn local_size(&self) -> usize {
        self.width(self.host)
    }

    /// The host of every group rank.
    pub(crate) fn host_of(&self) -> Vec<usize> {
        let mut out = vec![0; self.layout.iter().map(Vec::len).sum()];
        for (h, g) in self.layout.iter().enumerate() {
            for &r in g {
                out[r] = h;
            }
        }
        out
    }

    /// The local index of every group rank on its host.
    pub(crate) fn index_of(&self) -> Vec<usize> {
        let mut out = vec![0; self.layout.iter().map(Vec::len).sum()];
        for g in &self.layout {
            for (i, &r) in g.iter().enumerate() {
                out[r] = i;
            }
        }
        out
    }

    /// This rank's channels.
    pub(crate) fn mine(&self) -> Range<usize> {
        let per = self.channels / self.local_size();
        self.index * per..(self.index + 1) * per
    }

    /// The group rank that owns channel `c` on host `h`.
    pub(crate) fn owner(&self, h: usize, c: usize) -> usize {
        self.layout[h][c / (self.channels / self.width(h))]
    }

    /// `chans` cut into runs with one owner on host `h`: `(channels, owner)`.
    pub(crate) fn runs(&self, h: usize, chans: Range<usize>) -> Vec<(Range<usize>, usize)> {
        let mut out: Vec<(Range<usize>, usize)> = Vec::new();
        for c in chans {
            let q = self.owner(h, c);
            match out.last_mut() {
                Some((r, o)) if *o == q => r.end = c + 1,
                _ => out.push((c..c + 1, q)),
            }
        }
        out
    }

    /// This rank's channels cut into runs with one owner on every host:
    /// `(channels, owner on each host)`.
    pub(crate) fn segments(&self) -> Vec<(Range<usize>, Vec<usize>)> {
        let mut out: Vec<(Range<usize>, Vec<usize>)> = Vec::new();
        for c in self.mine() {
            let owners: Vec<usize> = (0..self.hosts()).map(|h| self.owner(h, c)).collect();
            match out.last_mut() {
                Some((r, o)) if *o == owners => r.end = c + 1,
                _ => out.push((c..c + 1, owners)),
            }
        }
        out
    }

    /// [`Plan::runs`] in bytes of a buffer that holds channels `chans` of
    /// `chan` bytes each, from `chans.start` on: `(byte range, owner)`.
    pub(crate) fn byte_runs(
        &self,
        h: usize,
        chans: Range<usize>,
        chan: usize,
    ) -> Vec<(Range<usize>, usize)> {
        let first = chans.start;
        self.runs(h, chans)
            .into_iter()
            .map(|(r, q)| ((r.start - first) * chan..(r.end - first) * chan, q))
            .collect()
    }
}
