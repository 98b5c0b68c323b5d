pub mod commands;
pub mod messages;
pub mod replies;
pub mod topics;
