pub mod commands;
pub mod messages;
pub mod topics;
