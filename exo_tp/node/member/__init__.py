"""A member's duties, whatever leads: answering its leader (control handlers), running its rank
(worker), keeping and fetching its weights, measuring its links."""
