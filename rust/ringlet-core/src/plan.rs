//! Where the ranks of a group spanning hosts sit, and which channels each
//! carries across hosts: the one plan behind both kinds of two levels. From
//! each rank's host ([`Plan::of_hosts`]) it gives the hosts in order of their
//! lowest rank, each host's ranks, this rank's host and index, the leaders
//! (each host's first rank), whether every host holds as many ranks (only
//! then do Bagua's levels have channel communicators), the channel count
//! and whether the group stays flat. The binding hands it to Python
//! (`_core.Plan`), where `ringlet.core.connection` connects by it the host
//! level of the core's two-level collectives (see `hierarchy` for the
//! channels and the pipeline; `Plan::new` checks the layout once when the
//! levels are attached) and Bagua's levels (`algorithms::Comms::hierarchical`
//! checks its communicators against it). Plain data and arithmetic.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::hash::Hash;
use std::ops::Range;

/// Where every rank sits and which channels it carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
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
pub const MAX_CHANNELS: usize = 1 << 10;

/// The lcm of the hosts' rank counts, saturating at `usize::MAX` (it is only
/// compared with [`MAX_CHANNELS`] beyond that).
fn lcm_of_widths(layout: &[Vec<usize>]) -> usize {
    layout
        .iter()
        .map(Vec::len)
        .fold(1, |c, l| (c / gcd(c, l)).saturating_mul(l))
}

impl Plan {
    /// The plan of a group whose rank r runs on host `hosts[r]` (any
    /// identity), seen from `rank`: hosts in order of their lowest rank,
    /// each host's ranks in rank order.
    pub fn of_hosts<H: Eq + Hash>(hosts: &[H], rank: usize) -> Result<Plan> {
        let mut at: HashMap<&H, usize> = HashMap::new();
        let mut layout: Vec<Vec<usize>> = Vec::new();
        for (r, h) in hosts.iter().enumerate() {
            let g = *at.entry(h).or_insert_with(|| {
                layout.push(Vec::new());
                layout.len() - 1
            });
            layout[g].push(r);
        }
        Plan::place(layout, rank).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "rank {rank} is not in a group of {} ranks",
                hosts.len()
            ))
        })
    }

    /// `layout` seen from `rank`; `None` when no host holds it.
    fn place(layout: Vec<Vec<usize>>, rank: usize) -> Option<Plan> {
        let host = layout.iter().position(|g| g.contains(&rank))?;
        let index = layout[host].iter().position(|&r| r == rank)?;
        let channels = lcm_of_widths(&layout);
        Some(Plan {
            layout,
            host,
            index,
            channels,
        })
    }

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
        let Some(plan) = Plan::place(layout, rank) else {
            return bad(format!("rank {rank} is on no host"));
        };
        let (index, width) = (plan.index, plan.local_size());
        if local_size != width || local_rank != index {
            return bad(format!(
                "the local communicator is rank {local_rank} of {local_size} but the layout puts rank {rank} at {index} of {width}"
            ));
        }
        if plan.channels > MAX_CHANNELS {
            return bad(format!(
                "hosts of {:?} ranks need {} channels (at most {MAX_CHANNELS})",
                plan.layout.iter().map(Vec::len).collect::<Vec<_>>(),
                plan.channels
            ));
        }
        Ok(plan)
    }

    /// The group ranks of each host, hosts in order.
    pub fn layout(&self) -> &[Vec<usize>] {
        &self.layout
    }

    /// This rank's host (its place in [`Plan::layout`]).
    pub fn host(&self) -> usize {
        self.host
    }

    /// This rank's index among its host's ranks.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Channels per cross-host buffer: the lcm of the hosts' rank counts
    /// (saturating).
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// The number of hosts.
    pub fn hosts(&self) -> usize {
        self.layout.len()
    }

    /// The number of ranks in the group.
    pub fn size(&self) -> usize {
        self.layout.iter().map(Vec::len).sum()
    }

    /// Ranks on host `h`.
    pub(crate) fn width(&self, h: usize) -> usize {
        self.layout[h].len()
    }

    /// The group ranks on this rank's host.
    pub fn local(&self) -> &[usize] {
        &self.layout[self.host]
    }

    /// Ranks on this host.
    pub fn local_size(&self) -> usize {
        self.width(self.host)
    }

    /// Each host's first rank (its *leader*), hosts in order.
    pub fn leaders(&self) -> Vec<usize> {
        self.layout.iter().map(|g| g[0]).collect()
    }

    /// Whether every host holds the same number of ranks.
    pub fn even(&self) -> bool {
        self.layout.iter().all(|g| g.len() == self.local_size())
    }

    /// Whether Bagua's levels have *channel* communicators (the ranks at one
    /// index on every host): on two hosts or more that each hold the same
    /// number of ranks, more than one.
    pub fn has_channels(&self) -> bool {
        self.even() && self.hosts() > 1 && self.local_size() > 1
    }

    /// Whether the group's collectives stay on one level: one host, one
    /// rank on every host, or more than [`MAX_CHANNELS`] channels.
    pub fn flat(&self) -> bool {
        self.hosts() < 2 || self.layout.iter().all(|g| g.len() == 1) || self.channels > MAX_CHANNELS
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

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(hosts: &[&str], rank: usize) -> Plan {
        Plan::of_hosts(hosts, rank).unwrap()
    }

    #[test]
    fn uneven_hosts_of_one_and_three() {
        let p = plan(&["a", "b", "b", "b"], 2);
        assert_eq!(p.layout(), &[vec![0], vec![1, 2, 3]]);
        assert_eq!((p.host(), p.index(), p.local()), (1, 1, &[1, 2, 3][..]));
        assert_eq!(p.leaders(), vec![0, 1]);
        assert_eq!((p.hosts(), p.size(), p.channels()), (2, 4, 3));
        assert!(!p.even() && !p.has_channels() && !p.flat());
        assert_eq!(plan(&["a", "b", "b", "b"], 0).local(), &[0]);
    }

    #[test]
    fn even_hosts_of_two_interleaved() {
        let p = plan(&["x", "y", "x", "y"], 3);
        assert_eq!(p.layout(), &[vec![0, 2], vec![1, 3]]);
        assert_eq!((p.host(), p.index(), p.channels()), (1, 1, 2));
        assert_eq!(p.leaders(), vec![0, 1]);
        assert!(p.even() && p.has_channels() && !p.flat());
        // The plan the levels attach with is the same.
        let attached = Plan::new(3, 4, 1, 2, p.layout().to_vec()).unwrap();
        assert_eq!(attached, p);
    }

    #[test]
    fn one_host_stays_flat() {
        let p = plan(&["a", "a", "a"], 1);
        assert_eq!(p.layout(), &[vec![0, 1, 2]]);
        assert_eq!((p.host(), p.index(), p.leaders()), (0, 1, vec![0]));
        assert!(p.even() && !p.has_channels() && p.flat());
    }

    #[test]
    fn one_rank_per_host_stays_flat() {
        let p = plan(&["a", "b"], 1);
        assert_eq!(p.layout(), &[vec![0], vec![1]]);
        assert_eq!((p.host(), p.index(), p.channels()), (1, 0, 1));
        assert_eq!(p.leaders(), vec![0, 1]);
        assert!(p.even() && !p.has_channels() && p.flat());
    }

    #[test]
    fn too_many_channels_stay_flat() {
        // Hosts of 31, 32 and 33 ranks: lcm 32736 channels.
        let hosts: Vec<usize> = [31, 32, 33]
            .iter()
            .enumerate()
            .flat_map(|(h, &n)| std::iter::repeat_n(h, n))
            .collect();
        let p = Plan::of_hosts(&hosts, 40).unwrap();
        assert_eq!((p.host(), p.index(), p.channels()), (1, 9, 32736));
        assert!(p.channels() > MAX_CHANNELS && p.flat() && !p.even());
        let err = Plan::new(40, hosts.len(), 9, 32, p.layout().to_vec()).unwrap_err();
        assert!(err.to_string().contains("32736 channels"), "{err}");
        // Many co-prime hosts saturate instead of overflowing.
        let primes = [
            2usize, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53,
        ];
        let hosts: Vec<usize> = primes
            .iter()
            .enumerate()
            .flat_map(|(h, &n)| std::iter::repeat_n(h, n))
            .collect();
        assert!(Plan::of_hosts(&hosts, 0).unwrap().flat());
    }

    #[test]
    fn a_rank_outside_the_group_is_refused() {
        let err = Plan::of_hosts(&["a", "b"], 2).unwrap_err();
        assert!(
            err.to_string().contains("rank 2 is not in a group of 2"),
            "{err}"
        );
    }
}
