//! Member writes that other parts of tidepool ask for. vk-provider alone creates and deletes
//! offload copies; the dispatcher, reclaiming a pod, asks it to free the copy now through a
//! [`CopyWriter`], and vk-provider carries the request out ahead of its ordinary work (see
//! `tidepool_vk::pods`), so a reclaim is as fast as a delete of its own.

use std::sync::Arc;

use tidepool_api::pod::PodLite;
use tokio::sync::{mpsc, oneshot};

use crate::MemberHandle;

/// Requests queued at most; a reclaim frees at most its victims at once.
const QUEUED: usize = 1024;

/// Delete the offload copy of reclaimed training pod `pod` in `member` now.
#[derive(Debug)]
pub struct FreeCopy {
    pub pod: Arc<PodLite>,
    pub member: Arc<MemberHandle>,
    /// The copy's UID as the member's pod watch saw it, for the delete's precondition.
    pub copy_uid: Option<String>,
    /// Answered once the member has answered the delete (whatever it said).
    pub done: oneshot::Sender<()>,
}

/// The asking end. Cheap to clone.
#[derive(Clone, Debug)]
pub struct CopyWriter(mpsc::Sender<FreeCopy>);

/// The carrying-out end, for vk-provider.
#[derive(Debug)]
pub struct CopyWrites(pub mpsc::Receiver<FreeCopy>);

/// A connected pair.
pub fn copy_writes() -> (CopyWriter, CopyWrites) {
    let (tx, rx) = mpsc::channel(QUEUED);
    (CopyWriter(tx), CopyWrites(rx))
}

impl CopyWriter {
    /// Asks for the copy of `pod` in `member` to be deleted and waits until the member has
    /// answered. Returns at once if vk-provider is gone (the process is stopping).
    pub async fn free_copy(&self, pod: Arc<PodLite>, member: Arc<MemberHandle>, copy_uid: Option<String>) {
        let (done, answered) = oneshot::channel();
        if self.0.send(FreeCopy { pod, member, copy_uid, done }).await.is_ok() {
            let _ = answered.await;
        }
    }
}
