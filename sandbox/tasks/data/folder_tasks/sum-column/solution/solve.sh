# the header says which column is the amount
head -n 1 sales.csv
awk -F, '$2=="north"{s+=$3} END{print s}' sales.csv > total.txt
