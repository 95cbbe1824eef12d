//! Barrier: returns once every rank has entered it. It is just the agreement
//! phase every collective starts with, carrying no data.

use crate::dtype::DType;
use crate::error::Result;
use crate::group::{Communicator, Link};
use crate::transport::OpKind;

impl Communicator {
    /// Blocks until every rank of the communicator has called `barrier`.
    pub fn barrier(&mut self) -> Result<()> {
        self.guarded(|c| {
            let desc = c.next_desc(OpKind::Barrier, DType::U8, None, 0, 0);
            match &mut c.link {
                Link::Local => Ok(()),
                Link::Shm { shm, .. } => {
                    shm.next_half();
                    shm.arrive(&desc)
                }
                Link::Tcp(mesh) => mesh.agree(&desc, c.cfg.timeout),
            }
        })
    }
}
