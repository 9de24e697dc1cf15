//! Named tasks that are meant to run as long as their owner, joined so none ends unseen.
//!
//! A [`Tasks`] set is a `JoinSet` that knows its tasks' names: [`Tasks::first_end`] resolves
//! when one of them ends or panics and says which, and dropping the set aborts them all (so a
//! component stopping takes its helpers with it). The binary keeps one for the components'
//! long-running tasks (see `src/supervise.rs`); a component keeps one for its helpers.

use std::collections::HashMap;
use std::future::Future;

use tokio::task::{Id, JoinSet};

/// Named tasks. Dropping the set aborts them.
#[derive(Debug, Default)]
pub struct Tasks {
    set: JoinSet<()>,
    names: HashMap<Id, &'static str>,
}

/// A task of a [`Tasks`] set that has ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub name: &'static str,
    /// "ended", "panicked" or "was cancelled".
    pub how: &'static str,
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "task {} {}", self.name, self.how)
    }
}

impl Tasks {
    /// Runs `task` as `name`.
    pub fn spawn(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        let handle = self.set.spawn(task);
        self.names.insert(handle.id(), name);
    }

    /// The name of task `id`.
    pub fn name(&self, id: Id) -> &'static str {
        self.names.get(&id).copied().unwrap_or("unnamed")
    }

    /// Names of the tasks still running.
    pub fn running(&self) -> Vec<&'static str> {
        self.names.values().copied().collect()
    }

    /// Waits for the next task to end and says which and how; pending forever once none is
    /// left, so it can sit in a `select!` beside the work it guards.
    pub async fn first_end(&mut self) -> Ended {
        let Some(ended) = self.set.join_next_with_id().await else {
            return std::future::pending().await;
        };
        let (id, how) = match ended {
            Ok((id, ())) => (id, "ended"),
            Err(e) if e.is_panic() => (e.id(), "panicked"),
            Err(e) => (e.id(), "was cancelled"),
        };
        let name = self.name(id);
        self.names.remove(&id);
        Ended { name, how }
    }

    /// Aborts every task still running.
    pub fn abort_all(&mut self) {
        self.set.abort_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_task_to_end_is_named_with_how() {
        let mut tasks = Tasks::default();
        tasks.spawn("forever", std::future::pending());
        tasks.spawn("short", async {});
        assert_eq!(tasks.first_end().await, Ended { name: "short", how: "ended" });
        tasks.spawn("broken", async { panic!("bug") });
        assert_eq!(tasks.first_end().await, Ended { name: "broken", how: "panicked" });
        assert_eq!(tasks.running(), vec!["forever"]);
        tasks.abort_all();
        assert_eq!(tasks.first_end().await, Ended { name: "forever", how: "was cancelled" });
    }

    #[tokio::test]
    async fn dropping_the_set_stops_its_tasks() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
        let mut tasks = Tasks::default();
        tasks.spawn("holder", async move {
            let _tx = tx;
            std::future::pending::<()>().await;
        });
        drop(tasks);
        assert_eq!(rx.recv().await, None, "the task, and the sender it held, are gone");
    }
}
